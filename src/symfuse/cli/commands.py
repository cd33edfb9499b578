"""Import every command module so that each registers its commands on the app."""

from symfuse.cli import (  # noqa: F401
    convert,
    drop,
    evaluate,
    inspect,
    match,
    match_many,
    merge,
    merge_lora,
    stats,
    train,
)
