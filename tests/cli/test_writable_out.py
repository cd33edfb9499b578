"""A file output in a folder this user cannot write is refused before the work (it failed after, on a temp file)."""

from __future__ import annotations

import os

import pytest
from typer.testing import CliRunner

from symfuse.cli import app
from symfuse.cli import commands as _commands  # noqa: F401  (registers the commands)
from tests.cli.helpers import toy_dataset
from tests.tiny import save_tiny_text_classifier


@pytest.mark.parametrize(("command", "name"), [("evaluate", "e.json"), ("inspect", "i.png")])
def test_an_unwritable_output_folder_is_refused_before_the_work(command, name, tmp_path, monkeypatch):
    model = save_tiny_text_classifier(tmp_path / "m", seed=1)
    data = toy_dataset(tmp_path / "toy")
    locked = tmp_path / "locked"
    locked.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if str(p) == str(locked) else real(p, mode, **kw))
    import symfuse.evaluate

    monkeypatch.setattr(symfuse.evaluate, "evaluate_model", lambda *a, **k: pytest.fail("evaluated first"))
    args = [command, str(model), *(["--data", str(data)] if command == "evaluate" else [str(model)])]
    res = CliRunner().invoke(app, [*args, "--out", str(locked / name)])
    assert res.exit_code == 2, res.output
    assert res.stderr.strip().splitlines()[-1] == (
        f"error: --out: {locked / name}: its folder {locked} is not writable by this user — choose another --out"
    )


def test_an_output_under_a_file_is_refused_before_the_work(tmp_path, monkeypatch):
    """evaluate ran over the whole split, then said "afile: file exists — check the path and its permissions"."""
    model = save_tiny_text_classifier(tmp_path / "m", seed=1)
    data = toy_dataset(tmp_path / "toy")
    (tmp_path / "afile").write_text("notes\n")
    import symfuse.evaluate

    monkeypatch.setattr(symfuse.evaluate, "evaluate_model", lambda *a, **k: pytest.fail("evaluated first"))
    args = ["evaluate", str(model), "--data", str(data)]
    out = tmp_path / "afile" / "sub" / "e.json"
    res = CliRunner().invoke(app, [*args, "--out", str(out)])
    assert res.exit_code == 2, res.output
    assert res.stderr.strip().splitlines()[-1] == (
        f"error: --out: {out}: {tmp_path / 'afile'} is a file, not a folder — choose another --out"
    )
    assert (tmp_path / "afile").read_text() == "notes\n"


def test_a_folder_that_permissions_allow_but_the_file_system_refuses_is_refused_before_the_work(tmp_path, monkeypatch):
    """As root, --out /proc/x.json passed the permission check; evaluate ran, then named a hidden temporary file."""
    import tempfile

    model = save_tiny_text_classifier(tmp_path / "m", seed=1)
    data = toy_dataset(tmp_path / "toy")
    odd = tmp_path / "odd"
    odd.mkdir()
    real = tempfile.mkstemp

    def mkstemp(*a, dir=None, **kw):
        if str(dir) == str(odd):
            raise FileNotFoundError(2, "No such file or directory")
        return real(*a, dir=dir, **kw)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    import symfuse.evaluate

    monkeypatch.setattr(symfuse.evaluate, "evaluate_model", lambda *a, **k: pytest.fail("evaluated first"))
    res = CliRunner().invoke(app, ["evaluate", str(model), "--data", str(data), "--out", str(odd / "e.json")])
    assert res.exit_code == 2, res.output
    assert res.stderr.strip().splitlines()[-1] == (
        f"error: --out: {odd / 'e.json'}: no file can be created in {odd} (No such file or directory) — choose "
        "another --out"
    )
    assert not list(odd.iterdir())


def test_a_config_json_that_is_a_pipe_is_refused_not_waited_on(tmp_path):
    """evaluate blocked reading a named pipe for ever."""
    from tests.cli.helpers import run_cli

    model = save_tiny_text_classifier(tmp_path / "m", seed=1)
    (model / "config.json").unlink()
    os.mkfifo(model / "config.json")
    for args in (["evaluate", model, "--data", toy_dataset(tmp_path / "toy")], ["inspect", model, model]):
        r = run_cli(*args, timeout=120)
        assert r.returncode != 0 and f"{model / 'config.json'}: not a regular file" in r.stderr, r.stderr
