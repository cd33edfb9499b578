"""The ``symfuse`` command line: one module per command group, registered on one typer app."""

import logging

import typer

from symfuse.logs import quiet_third_party

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Symmetry-aware fusion of transformer models.")


@app.callback()
def _setup(verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logging.")) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    quiet_third_party(verbose)  # no per-checkpoint load reports / progress bars unless -v


def main() -> None:
    """Console-script entry point."""
    # Command modules register themselves on `app` when imported.
    from symfuse.cli import commands  # noqa: F401

    app()
