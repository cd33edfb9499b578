"""The command line's one error boundary: every exception becomes ONE line on stderr and an exit status.

``error: <artifact>: <what is wrong> — <fix>``; exit 2 for usage errors (bad options and values, an existing
``--out``), 1 for data errors (bad checkpoint, statistics or dataset, non-finite values, a locked output) and for
internal errors (bugs: ``error: internal error: <type>: <msg> (run with -v for the traceback)``). With ``-v`` the
traceback is printed first. :func:`exit_status` is the one place exceptions map to exit codes.
"""

from __future__ import annotations

import itertools
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import typer
from typer._click import exceptions as cx  # typer's own click (typer >= 0.20 vendors it)
from typer.core import TyperGroup, TyperOption

from symfuse.errors import MissingStats, OutputExistsError, SymfuseError, UsageError
from symfuse.io.safetensors import DISK_FULL, DISK_FULL_FIX
from symfuse.outputs import Terminated
from symfuse.redact import redact

USAGE, DATA, INTERRUPTED = 2, 1, 130
VERBOSE_FLAGS = ("-v", "--verbose")

# Exceptions from libraries the commands call that mean "this input is bad", not "symfuse has a bug".
_DATA_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError, EOFError)
try:  # the safetensors reader's own error type (truncated or garbled files)
    from safetensors import SafetensorError

    _DATA_ERRORS += (SafetensorError,)
except ImportError:  # pragma: no cover
    pass


def exit_status(exc: BaseException) -> int | None:
    """The exit status for ``exc``: 2 usage, 1 data, 130 interrupted; None for an internal error (a bug)."""
    if isinstance(exc, KeyboardInterrupt):
        return INTERRUPTED
    if isinstance(exc, (cx.UsageError, UsageError, OutputExistsError, MissingStats)):
        return USAGE
    if isinstance(exc, (SymfuseError, cx.ClickException, *_DATA_ERRORS)):
        return DATA
    return None


def _message(exc: BaseException) -> str:
    if isinstance(exc, cx.UsageError):
        cmd = exc.ctx.command_path if exc.ctx is not None else "symfuse"
        return f"{cmd}: {exc.format_message().rstrip('.')} — see '{cmd} --help'"
    if isinstance(exc, cx.ClickException):
        return exc.format_message()
    errors = getattr(exc, "errors", None)  # pydantic ValidationError: one "field: problem" per error
    if callable(errors) and isinstance(exc, ValueError) and hasattr(exc, "title"):
        try:
            found = [(".".join(map(str, e["loc"])), str(e["msg"]).removeprefix("Value error, ")) for e in errors()]
            return "; ".join(f"{loc}: {msg}" if loc else msg for loc, msg in found)  # not "RunConfig: : Value error,"
        except Exception:
            pass
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        # a full disk: the path and its permissions are fine
        fix = DISK_FULL_FIX if exc.errno in DISK_FULL else "check the path and its permissions"
        return f"{exc.filename}: {exc.strerror[:1].lower()}{exc.strerror[1:]} — {fix}"
    text = str(exc).strip()
    return text or type(exc).__name__


def one_line(exc: BaseException) -> str:
    """``error: ...`` for ``exc``: the first line of its message (internal errors name their type)."""
    if isinstance(exc, KeyboardInterrupt):
        from symfuse.outputs import published

        if done := published():  # the interrupt came after the output was in place: it is whole, and stays
            return f"error: interrupted after {', '.join(done)} was written whole (it stays); nothing partial is left"
        return "error: interrupted — partial output was removed; run the command again"
    text = " ".join(redact(_message(exc)).split("\n", 1)[0].split())  # no credential on the console
    text = text.removeprefix("error: ")
    if exit_status(exc) is None:
        return f"error: internal error: {type(exc).__name__}: {text} (run with -v for the traceback)"
    return f"error: {text}"


def report(exc: BaseException, verbose: bool) -> int:
    """Print ``exc`` (traceback first with ``verbose``) on stderr; return the exit status."""
    if verbose and not isinstance(exc, cx.UsageError):
        sys.stderr.write(redact("".join(traceback.format_exception(exc))))
    typer.echo(one_line(exc), err=True)
    return exit_status(exc) or DATA


def run_script(main: Callable[[list[str]], int], argv: Sequence[str] | None = None) -> int:
    """Run a script's ``main(argv)`` (the examples) behind the commands' boundary.

    A failure is one line and its exit status, the traceback only with ``-v`` / ``--verbose`` (taken out of
    ``argv``, default ``sys.argv[1:]``).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    verbose = any(a in VERBOSE_FLAGS for a in args)
    try:
        return main([a for a in args if a not in VERBOSE_FLAGS])
    except KeyboardInterrupt:
        typer.echo("error: interrupted", err=True)
        return INTERRUPTED
    except Exception as exc:
        return report(exc, verbose)


def split_verbose(args: Sequence[str]) -> tuple[bool, list[str]]:
    """Pull ``-v`` / ``--verbose`` from anywhere in ``args`` (so ``symfuse merge ... -v`` works too)."""
    verbose = any(a in VERBOSE_FLAGS for a in args)
    rest = [a for a in args if a not in VERBOSE_FLAGS]
    return verbose, (["--verbose"] if verbose else []) + rest


def _options(command: Any, secondary: bool = False) -> dict[str, TyperOption]:
    """``command``'s options by each of their names (``--flag``; with ``secondary``, ``--no-flag`` too)."""
    return {
        name: p
        for p in command.params
        if isinstance(p, TyperOption)
        for name in (*p.opts, *(p.secondary_opts if secondary else ()))
    }


def misplaced_value(command: Any, argv: Sequence[str]) -> str | None:
    """Why an option of ``command`` got no real value in ``argv``, or None.

    click takes the token after an option as its value whatever it is: ``--out --overwrite`` wrote a folder named
    ``--overwrite``, and ``--out ''`` meant the current folder, ``--store ''`` the default store.
    """
    options = _options(command)
    for option, value in itertools.pairwise(argv):
        param = options.get(option)
        if param is None or param.is_flag or param.count:
            continue
        if value in options:
            return (
                f"{option}: given {value!r}, another option of this command, as its value — give {option} a value "
                f"(a name starting with '-' is written ./{value})"
            )
        if not value.strip():
            default = "" if param.required else f" (or leave {option} out for its default)"
            return f"{option}: the value is empty — give one{default}"
    return None


def repeated_option(command: Any, argv: Sequence[str]) -> str | None:
    """Which option of ``command`` is given twice in ``argv`` (by one name or two), or None.

    click keeps the last value of an option given twice (``--out a --out b`` wrote b) and appends the values of a
    list option (``--models a b --models b a`` merged four models). Options meant to repeat (``--param k=v``) may.
    """
    options = _options(command, secondary=True)
    lists = set(getattr(command, "multi_value", ()))
    seen: dict[int, str] = {}
    for word in argv:
        if word == "--":
            break
        name = word.split("=", 1)[0] if word.startswith("--") else word
        param = options.get(name)
        if param is None or param.count or (param.multiple and not lists & set(param.opts)):
            continue
        if id(param) in seen:
            also = f" (also as {seen[id(param)]})" if seen[id(param)] != name else ""
            fix = f"give its values after one {name}: {name} A B ..." if lists & set(param.opts) else "give it once"
            return f"{name}: given twice{also} — {fix}"
        seen[id(param)] = name
    return None


class BoundaryGroup(TyperGroup):
    """The app's click group: runs the command without click's standalone handling and reports errors itself."""

    def main(  # type: ignore[override]
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        """Run the CLI; exit (or return, without ``standalone_mode``) with the status of :func:`exit_status`."""
        from symfuse.outputs import clear_published

        verbose, argv = split_verbose(list(sys.argv[1:] if args is None else args))
        clear_published()  # an interrupt names only what this command wrote
        try:
            words = [str(a) for a in argv]  # in-process callers pass paths too
            command = self.commands.get(next((a for a in words if not a.startswith("-")), ""))
            problem = (misplaced_value(command, words) or repeated_option(command, words)) if command else None
            if problem:
                raise UsageError(problem)
            rv = super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
            code = rv if isinstance(rv, int) else 0
            if code == INTERRUPTED:  # typer turns KeyboardInterrupt into Exit(130)
                typer.echo(one_line(KeyboardInterrupt()), err=True)
        except cx.NoArgsIsHelpError as exc:
            exc.show()
            code = exc.exit_code
        except Terminated as exc:
            typer.echo("error: terminated by SIGTERM — partial output was removed", err=True)
            code = int(exc.code or 143)
        except typer.Exit as exc:
            code = exc.exit_code
        except typer.Abort:
            typer.echo("error: aborted", err=True)
            code = DATA
        except SystemExit:
            raise
        except BaseException as exc:
            code = report(exc, verbose)
        if standalone_mode:
            sys.exit(code)
        return code
