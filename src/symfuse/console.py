"""The ``symfuse`` console script: the CLI, with a Ctrl-C during its start-up told in one line.

Importing the CLI takes a few seconds (torch, transformers); a Ctrl-C in that time raised KeyboardInterrupt inside
an import and printed its traceback. This module imports nothing heavy until :func:`main` runs.
"""

from __future__ import annotations

import importlib
import sys

from symfuse.errors import INTERRUPTED_STARTING


def start(entry: str) -> None:
    """Import ``module:function``, run it and exit with what it returns; a Ctrl-C during the import: one line, 130.

    The ``symfuse`` command and ``python -m flows`` start through it.
    """
    module, _, name = entry.partition(":")
    try:
        function = getattr(importlib.import_module(module), name)
    except KeyboardInterrupt:
        print(INTERRUPTED_STARTING, file=sys.stderr)
        raise SystemExit(130) from None
    sys.exit(function())


def main() -> None:
    """Run the ``symfuse`` command (:func:`symfuse.cli.main`)."""
    start("symfuse.cli:main")
