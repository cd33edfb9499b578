"""Killed, interrupted and concurrent writers (issue 13): ``--out`` is whole or absent, temp folders don't linger.

The commands run as subprocesses through :mod:`tests.cli.pausing_cli`, which pauses right after the first weight
shard lands in the temporary folder, so that each test signals the process at a known point of its write.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.cli.helpers import cli_command, cli_env, listing, run_cli
from tests.tiny import save_tiny


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("models")
    return save_tiny(d / "a", "bert", seed=1), save_tiny(d / "b", "bert", seed=2)


def _start_paused(marker: Path, *args: object) -> subprocess.Popen[str]:
    return subprocess.Popen(
        cli_command(marker, *args, module="tests.cli.pausing_cli"),
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_paused(proc: subprocess.Popen[str], marker: Path, timeout: float = 300) -> Path:
    """The temporary folder the paused writer is filling."""
    end = time.monotonic() + timeout
    while not marker.exists():
        if proc.poll() is not None:
            pytest.fail(f"writer exited {proc.returncode} before pausing:\n{proc.stderr.read()}")
        if time.monotonic() > end:
            proc.kill()
            pytest.fail("writer never reached its write")
        time.sleep(0.05)
    time.sleep(0.1)  # the marker's text is written
    return Path(marker.read_text())


def _leftovers(folder: Path, name: str = "out") -> list[str]:
    """Hidden siblings of ``folder/name`` (temp folders, lock files)."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(".") and name in p.name)


def _merge(models, out, *extra):
    a, b = models
    return ("merge", "--strategy", "simple", "--models", a, b, "--out", out, *extra)


def test_sigkill_during_merge_keeps_the_previous_version_and_the_next_run_cleans_up(models, tmp_path):
    out = tmp_path / "out"
    first = run_cli(*_merge(models, out, "--weights", "1", "1"))
    assert first.returncode == 0, first.stderr
    previous = listing(out)
    proc = _start_paused(tmp_path / "marker", *_merge(models, out, "--weights", "1", "3", "--overwrite"))
    half = _wait_paused(proc, tmp_path / "marker")
    proc.send_signal(signal.SIGKILL)
    proc.wait(60)
    assert listing(out) == previous  # the previous version, whole and readable
    load_file(str(out / "model.safetensors"))
    assert half.exists() and half.parent == tmp_path and half.name.startswith((".out.tmp-", "..out.tmp-"))
    assert _leftovers(tmp_path)  # SIGKILL cannot clean: the half artifact is hidden next to out
    again = run_cli(*_merge(models, out, "--weights", "1", "3", "--overwrite"))
    assert again.returncode == 0, again.stderr
    assert _leftovers(tmp_path) == []  # the dead writer's temp folders are gone
    assert listing(out) != previous
    a, b = (load_file(str(m / "model.safetensors")) for m in models)
    name = "encoder.layer.0.output.dense.weight"
    assert load_file(str(out / "model.safetensors"))[name].allclose((a[name] + 3 * b[name]) / 4)


def test_sigkill_during_match_leaves_no_output_and_the_next_run_cleans_up(models, tmp_path):
    out = tmp_path / "out"
    a, b = models
    proc = _start_paused(tmp_path / "marker", "match", a, b, "--out", out)
    half = _wait_paused(proc, tmp_path / "marker")
    proc.send_signal(signal.SIGKILL)
    proc.wait(60)
    assert not out.exists()  # no half artifact readable at --out
    assert half.exists() and _leftovers(tmp_path)
    again = run_cli("match", a, b, "--out", out)
    assert again.returncode == 0, again.stderr
    assert _leftovers(tmp_path) == []
    assert (out / "symfuse_report.json").exists() and (out / "model.safetensors").exists()


def test_second_match_on_one_out_fails_fast_then_sigterm_removes_the_temp_folder(models, tmp_path):
    out = tmp_path / "out"
    a, b = models
    proc = _start_paused(tmp_path / "marker", "match", a, b, "--out", out)
    half = _wait_paused(proc, tmp_path / "marker")
    second = run_cli("match", b, a, "--out", out)
    lines = second.stderr.strip().splitlines()
    assert second.returncode == 1, second.stderr
    assert len(lines) <= 3 and f"pid {proc.pid}" in lines[-1] and str(out) in lines[-1] and "lock" in lines[-1]
    assert "Traceback" not in second.stderr
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert err.strip().splitlines()[-1].startswith("error: terminated")
    assert not half.exists() and not out.exists()
    assert _leftovers(tmp_path) == []  # temp folders and the lock file removed


def test_sigint_during_merge_removes_the_temp_folder(models, tmp_path):
    out = tmp_path / "out"
    proc = _start_paused(tmp_path / "marker", *_merge(models, out))
    half = _wait_paused(proc, tmp_path / "marker")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1].startswith("error: interrupted") and "Traceback" not in err
    assert not half.exists() and not out.exists() and _leftovers(tmp_path) == []


def test_ctrl_c_while_the_command_starts_is_one_line(monkeypatch, capsys):
    """The seconds of imports before a command runs: a Ctrl-C there printed a KeyboardInterrupt traceback."""
    import importlib

    import typer

    import symfuse.console

    real_import = importlib.import_module

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    def import_interrupted(name, *args, **kwargs):
        return interrupted() if name == "symfuse.cli" else real_import(name, *args, **kwargs)

    for target, name, fake in (
        (typer.main, "get_command", interrupted),
        (importlib, "import_module", import_interrupted),
    ):
        with monkeypatch.context() as m:  # typer building the command group; the CLI's own import
            m.setattr(target, name, fake)
            with pytest.raises(SystemExit) as info:
                symfuse.console.main()
        assert info.value.code == 130
        err = capsys.readouterr().err
        assert err == "error: interrupted while the command was starting — nothing was written\n", err


def test_an_interrupt_after_the_output_is_in_place_says_it_stays(tmp_path, monkeypatch):
    """evaluate wrote its metrics, then a Ctrl-C said 'partial output was removed' over a whole file that stayed."""
    import json as _json

    from typer.testing import CliRunner

    import symfuse.cli.evaluate
    from symfuse.cli import app
    from tests.cli.helpers import toy_dataset
    from tests.tiny import save_tiny_text_classifier

    model = save_tiny_text_classifier(tmp_path / "m", seed=1)
    out = tmp_path / "e.json"

    class Late:  # json.dumps of the metrics, after the file is in place
        @staticmethod
        def dumps(*a, **k):
            raise KeyboardInterrupt

    monkeypatch.setattr(symfuse.cli.evaluate, "json", Late)
    data = str(toy_dataset(tmp_path / "d"))
    res = CliRunner().invoke(app, ["evaluate", str(model), "--data", data, "--labels-from", data, "--out", str(out)])
    assert res.exit_code == 130, res.stderr
    assert (
        res.stderr.strip().splitlines()[-1]
        == f"error: interrupted after {out} was written whole (it stays); nothing partial is left"
    )
    assert _json.loads(out.read_text())["n"] == 8
