"""The CLI's one error boundary: exception -> exit status, one line, traceback only with ``-v`` (in-process)."""

from __future__ import annotations

import pytest
import typer
from safetensors import SafetensorError
from typer._click import exceptions as cx
from typer.testing import CliRunner

from symfuse.cli import checks
from symfuse.cli.boundary import BoundaryGroup, exit_status, one_line
from symfuse.errors import (
    CheckpointError,
    DataError,
    MissingStats,
    OutputExistsError,
    OutputLockedError,
    SymfuseError,
    UsageError,
)


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (UsageError("--x: bad — fix"), 2),
        (OutputExistsError("out: exists — --overwrite"), 2),
        (MissingStats("needs gram — --stats"), 2),
        (cx.BadParameter("bad"), 2),
        (cx.NoSuchOption("--nope"), 2),
        (DataError("m: NaN — re-export"), 1),
        (CheckpointError("m: no config.json"), 1),
        (OutputLockedError("out: locked by pid 1"), 1),
        (SymfuseError("anything deliberate"), 1),
        (ValueError("bad value"), 1),
        (FileNotFoundError(2, "No such file or directory", "/x/y"), 1),
        (SafetensorError("header too small"), 1),
        (KeyboardInterrupt(), 130),
        (RuntimeError("a bug"), None),
        (KeyError("a bug"), None),
        (AttributeError("a bug"), None),
    ],
)
def test_exit_status_mapping(exc, code):
    assert exit_status(exc) == code


def test_typed_errors_are_builtins():
    assert issubclass(UsageError, ValueError) and issubclass(DataError, ValueError)
    assert issubclass(OutputExistsError, FileExistsError) and issubclass(OutputLockedError, OSError)
    assert all(issubclass(e, SymfuseError) for e in (UsageError, DataError, OutputExistsError, OutputLockedError))


def test_one_line_keeps_the_first_line_and_names_os_errors():
    assert one_line(ValueError("first\nsecond")) == "error: first"
    assert one_line(FileNotFoundError(2, "No such file or directory", "/x/y")).startswith("error: /x/y")
    assert one_line(PermissionError(13, "Permission denied", "/x/y")).endswith("check the path and its permissions")
    full = one_line(OSError(28, "No space left on device", "/tmp/a/b"))  # a full disk: the fix is space, not the path
    assert full.startswith("error: /tmp/a/b: no space left on device — free disk space there"), full
    line = one_line(KeyError("k"))
    assert line.startswith("error: internal error: KeyError:") and "-v" in line


def test_a_checkpoint_read_error_keeps_its_cause(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(DataError) as info:
        checks.checkpoint(tmp_path, arch=False)
    assert isinstance(info.value.__cause__, SafetensorError)
    assert str(tmp_path) in str(info.value) and " — " in str(info.value)


def _app() -> typer.Typer:
    app = typer.Typer(cls=BoundaryGroup, pretty_exceptions_enable=False, add_completion=False)

    @app.callback()
    def _cb(verbose: bool = typer.Option(False, "--verbose", "-v")) -> None:
        pass

    @app.command()
    def bug() -> None:
        {}["missing"]

    @app.command()
    def data() -> None:
        raise DataError("model.safetensors: holds NaN — re-export it")

    @app.command()
    def write(out: str = typer.Option("o", "--out"), overwrite: bool = typer.Option(False, "--overwrite")) -> None:
        typer.echo(f"wrote {out!r}")

    @app.command()
    def need(out: str = typer.Option(..., "--out")) -> None:
        typer.echo(f"wrote {out!r}")

    @app.command()
    def leak() -> None:
        raise OSError("s3://AKIATESTKEY0000:testSECRETvalue99@bucket/p/runs: store operation failed")

    return app


@pytest.mark.parametrize(
    ("args", "code", "line"),
    [
        (["bug"], 1, "error: internal error: KeyError: 'missing' (run with -v for the traceback)"),
        (["data"], 1, "error: model.safetensors: holds NaN — re-export it"),
        (["data", "--what"], 2, "No such option: --what"),
        (["write", "--out", "--overwrite"], 2, "error: --out: given '--overwrite', another option of this command"),
        (["write", "--out", ""], 2, "error: --out: the value is empty — give one (or leave --out out"),
        (["need", "--out", ""], 2, "error: --out: the value is empty — give one"),
        (["write", "--out", " "], 2, "error: --out: the value is empty"),
        (["leak"], 1, "error: s3://[REDACTED]@bucket/p/runs: store operation failed"),
        (["write", "--out", "a", "--out", "b"], 2, "error: --out: given twice — give it once"),  # click kept b
        (["write", "--out=a", "--overwrite", "--out", "b"], 2, "error: --out: given twice — give it once"),
        (["write", "--overwrite", "--overwrite"], 2, "error: --overwrite: given twice — give it once"),
    ],
)
def test_boundary_prints_one_line_and_the_traceback_only_with_v(args, code, line):
    runner = CliRunner()
    quiet = runner.invoke(_app(), args)
    assert quiet.exit_code == code
    lines = quiet.stderr.strip().splitlines()
    assert len(lines) == 1 and line in lines[0] and "Traceback" not in quiet.output
    loud = runner.invoke(_app(), [*args, "-v"])
    assert loud.exit_code == code
    assert loud.stderr.strip().splitlines()[-1] == lines[0]
    if code == 1:
        assert "Traceback (most recent call last)" in loud.stderr
    assert "wrote" not in quiet.output + loud.output  # refused before the command ran
    assert "testSECRETvalue99" not in quiet.output + loud.output  # not in the line, nor in -v's traceback


def test_an_option_value_that_only_looks_odd_still_runs():
    res = CliRunner().invoke(_app(), ["write", "--out", "./--overwrite"])
    assert res.exit_code == 0 and "wrote './--overwrite'" in res.output


def test_a_list_option_given_twice_is_refused_and_a_repeatable_one_is_not(tmp_path):
    from symfuse.cli import app
    from symfuse.cli import commands as _commands  # noqa: F401

    args = ["merge", "--strategy", "simple", "--out", str(tmp_path / "o")]
    twice = CliRunner().invoke(app, [*args, "--models", "a", "b", "--models", "b", "a"])  # click merged four models
    assert twice.exit_code == 2
    assert twice.stderr.strip() == "error: --models: given twice — give its values after one --models: --models A B ..."
    params = CliRunner().invoke(app, [*args, "--models", "a", "b", "--param", "x=1", "--param", "y=2"])
    assert params.exit_code == 2 and "given twice" not in params.stderr  # --param repeats; the models are missing
    assert not (tmp_path / "o").exists()


def test_merge_help_lists_every_option():
    from symfuse.cli import app
    from symfuse.cli import commands as _commands  # noqa: F401

    res = CliRunner().invoke(app, ["merge", "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0
    for opt in ("--strategy", "--models", "--stats", "--weights", "--base", "--alpha", "--lam", "--density", "--drop",
                "--combine", "--seed", "--dtype", "--epsilon", "--out", "--overwrite"):  # fmt: skip
        assert opt in res.output, opt


def test_merge_multi_value_options_are_split_per_flag(monkeypatch):
    rewritten = []
    monkeypatch.setattr(checks.TyperCommand, "parse_args", lambda self, ctx, args: rewritten.append(list(args)) or [])
    cmd = checks.multi_value_command("--models", "--weights")(name="merge")
    cmd.parse_args(None, ["--models", "a", "b", "--weights", "1", "-2", "--out", "o", "--models", "c"])
    assert rewritten == [
        ["--models", "a", "--models", "b", "--weights", "1", "--weights", "-2", "--out", "o", "--models", "c"]
    ]
