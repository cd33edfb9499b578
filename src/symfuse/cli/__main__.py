"""``python -m symfuse.cli``: the ``symfuse`` command."""

from symfuse.cli import main

if __name__ == "__main__":
    main()
