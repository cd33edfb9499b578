"""The ``symfuse`` console script: the CLI, with a Ctrl-C during its start-up told in one line.

Importing the CLI takes a few seconds (torch, transformers); a Ctrl-C in that time raised KeyboardInterrupt inside
an import and printed its traceback. This module imports nothing heavy until :func:`main` runs.
"""

from __future__ import annotations

import sys

from symfuse.errors import INTERRUPTED_STARTING


def main() -> None:
    """Run the ``symfuse`` command (:func:`symfuse.cli.main`); exit 130 with one line if interrupted starting."""
    try:
        from symfuse.cli import main as cli_main
    except KeyboardInterrupt:
        print(INTERRUPTED_STARTING, file=sys.stderr)
        raise SystemExit(130) from None
    cli_main()
