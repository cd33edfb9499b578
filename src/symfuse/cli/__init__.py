"""The ``symfuse`` command line: one module per command group, registered on one typer app.

Every command runs inside one error boundary (:mod:`symfuse.cli.boundary`): an error prints one line
``error: <artifact>: <what is wrong> — <fix>`` on stderr and exits 2 (usage) or 1 (data); ``-v`` (anywhere on the
command line) adds the traceback and debug logging.
"""

import logging

import typer

from symfuse.cli.boundary import BoundaryGroup
from symfuse.logs import quiet_third_party
from symfuse.redact import install_log_redaction

app = typer.Typer(
    cls=BoundaryGroup,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="Symmetry-aware fusion of transformer models.",
)


@app.callback()
def _setup(verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logging and tracebacks.")) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # botocore / s3fs DEBUG records carry request headers: no credential reaches any handler, even at -v
    install_log_redaction()
    quiet_third_party(verbose)  # no per-checkpoint load reports / progress bars unless -v


def main() -> None:
    """Console-script entry point (a Ctrl-C before the command runs is one line too, exit 130)."""
    from symfuse.cli.boundary import INTERRUPTED
    from symfuse.errors import INTERRUPTED_STARTING

    try:
        # Command modules register themselves on `app` when imported.
        from symfuse.cli import commands  # noqa: F401

        command = typer.main.get_command(app)  # typer builds the click group (seconds of imports) before it runs
    except KeyboardInterrupt:
        typer.echo(INTERRUPTED_STARTING, err=True)
        raise SystemExit(INTERRUPTED) from None
    command.main(prog_name="symfuse")
