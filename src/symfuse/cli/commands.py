"""Import every command module so that each registers its commands on the app."""
