"""Import every command module so that each registers its commands on the app."""

from symfuse.cli import evaluate, merge, stats, train  # noqa: F401
from symfuse.cli import match  # noqa: F401
