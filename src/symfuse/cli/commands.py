"""Import every command module so that each registers its commands on the app."""
from symfuse.cli import merge, stats  # noqa: F401
from symfuse.cli import match  # noqa: F401
