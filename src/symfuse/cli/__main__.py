"""``python -m symfuse.cli``: the ``symfuse`` command."""

from symfuse.cli import main

main()
