"""The demo's command line: a bad config or a failed run ends with ONE error line and a non-zero exit."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows.cli import _NoTraceback, drain_events, main, quiet_temporary_server
from tests.flows.conftest import tiny_config


@pytest.fixture
def console_formatters():
    """Restore every handler's formatter afterwards (the command hides tracebacks on the console)."""
    handlers = [h for lg in (logging.getLogger(), *logging.Logger.manager.loggerDict.values())
                if isinstance(lg, logging.Logger) for h in lg.handlers]  # fmt: skip
    saved = [(h, h.formatter) for h in handlers]
    yield
    for h, f in saved:
        h.setFormatter(f)


def test_a_bad_config_is_one_line_naming_the_file(tmp_path, capfd):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("run_id: x\nstrategies: [simpel]\n")
    assert main(["--config", str(cfg)]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {cfg}: ") and "simpel" in err[0], err
    assert main(["--config", str(tmp_path / "missing.yaml")]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "missing.yaml" in err[0]
    cfg.write_text("run_id: x\ndatasets: [{name: meld}\nstrategies: [simple]\n")  # a YAML syntax error
    assert main(["--config", str(cfg)]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert err == [f"error: {cfg}: not valid YAML at line 3, column 1 (expected ',' or ']', but got '<scalar>') — "
                   "fix the syntax there"], err  # fmt: skip
    cfg.write_text("run_id: x\ndatasets: [{name: meld}, {name: isear}]\nstrategies: [simple]\n")
    assert main(["--config", str(cfg), "--run-id", "../../escaped"]) == 2  # was taken unchecked, then Prefect failed
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --run-id: run id '../../escaped': use 1-100 letters"), err
    cfg.write_text("run_id: x\nanchor: nope\ndatasets: [{name: meld}, {name: isear}]\n")  # a whole-config check
    assert main(["--config", str(cfg)]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {cfg}: anchor 'nope': expected 'closest', 'barycenter' or"), err
    cfg.write_text("run_id: x\nstrategies: [simple]\nrun_id: y\n")  # the last would win silently
    assert main(["--config", str(cfg)]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert err == [f"error: {cfg}: line 3: key 'run_id' given twice (first at line 1) — keep one"], err


def test_options_that_would_be_ignored_are_refused(tmp_path, capfd):
    """--quick with --config ran the whole config, an empty --store used $SYMFUSE_STORE: each without a word."""
    cfg = tmp_path / "run.yaml"
    cfg.write_text("run_id: x\ndatasets: [{name: meld}, {name: isear}]\n")
    for args, words in [(["--config", str(cfg), "--quick"], "error: --quick reduces the demo config and is ignored"),
                        (["--store", ""], "error: --store is empty — give the store root")]:  # fmt: skip
        assert main(args) == 2
        err = capfd.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(words), err


@pytest.mark.parametrize("args", [["--store", "a", "--store", "b"], ["--run-id=a", "--run-id", "b"]])
def test_an_option_given_twice_is_refused(args, capfd):
    with pytest.raises(SystemExit) as info:  # argparse kept the last value without a word
        main(args)
    assert info.value.code == 2
    assert capfd.readouterr().err.strip().splitlines()[-1].endswith(f"{args[-2]}: given twice — give it once")


def test_an_in_memory_store_is_refused_before_the_run(tiny_base, tmp_path, capfd, monkeypatch):
    config = tiny_config(tiny_base, "memory://kept-nowhere", run_id="mem", strategies=["simple"])
    config.to_yaml(tmp_path / "run.yaml")  # the run exited 0 and every artifact ended with the process
    for args, where in ((["--config", str(tmp_path / "run.yaml")], f"store_root of {tmp_path / 'run.yaml'}"),
                        (["--store", "memory://x"], "--store"), ([], "$SYMFUSE_STORE")):  # fmt: skip
        monkeypatch.setenv("SYMFUSE_STORE", "memory://x")
        assert main(args) == 2
        err = capfd.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: {where} memory://"), err
        assert "an in-memory store ends with this process" in err[0]


def test_a_failed_run_is_one_error_line_and_no_traceback(nan_base, tmp_path, capfd, console_formatters):
    config = tiny_config(nan_base, str(tmp_path / "store"), run_id="cli-fails", strategies=["simple"], anchor="closest",
                         datasets=[{"name": n, "max_train_examples": 8} for n in ("meld", "isear")])  # fmt: skip
    cfg = tmp_path / "run.yaml"
    config.to_yaml(cfg)
    assert main(["--config", str(cfg)]) == 1  # the inputs pass the checks; the fine-tune finds the NaN
    out = capfd.readouterr()
    text = out.out + out.err
    assert "Traceback" not in text
    last = out.err.strip().splitlines()[-1]
    assert last.startswith("error: ") and "NaN" in last and str(nan_base) in last, last
    # the console handlers now drop tracebacks; a record's traceback still reaches other handlers
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", None, __import__("sys").exc_info())
    assert "boom" not in _NoTraceback(logging.Formatter()).format(record)
    assert "boom" in logging.Formatter().format(record)


def _fresh_run(base: Path, tmp_path: Path, run_id: str) -> dict[str, str]:
    """Write ``tmp_path/run.yaml`` (two tiny datasets, simple) and return the env of a fresh ``python -m flows``."""
    datasets = [{"name": n, "max_train_examples": 8} for n in ("meld", "isear")]
    config = tiny_config(base, str(tmp_path / "store"), run_id=run_id, strategies=["simple"], datasets=datasets)
    config.to_yaml(tmp_path / "run.yaml")
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env["PYTHONPATH"] = os.pathsep.join([str(root / "src"), str(root)])
    return env | {"PREFECT_HOME": str(tmp_path / "prefect")}


def test_a_failed_run_in_a_fresh_process_prints_no_traceback(nan_base, tmp_path):
    """``python -m flows`` as users run it: Prefect's console handlers appear after the command starts, and its flow
    engine logs the failure with the traceback; without -v the console shows the line, not the traceback."""
    env = _fresh_run(nan_base, tmp_path, "fresh")
    res = subprocess.run([sys.executable, "-m", "flows", "--config", "run.yaml"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert res.returncode == 1, res.stderr[-2000:]
    assert "Traceback" not in res.stderr + res.stdout, res.stderr[-4000:]
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error: ")]  # the server's stop line follows it
    assert len(errors) == 1 and "NaN" in errors[0] and str(nan_base) in errors[0], errors


def _started_run(base: Path, tmp_path: Path, run_id: str) -> tuple[subprocess.Popen, list[str]]:
    """``python -m flows`` in a process group of its own, read until its first task has started (the flow runs)."""
    env = _fresh_run(base, tmp_path, run_id)
    command = [sys.executable, "-m", "flows", "--config", "run.yaml"]
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if "Task run" in line:
            return proc, lines
    proc.wait(timeout=60)
    pytest.fail("the run ended before a task started:\n" + "".join(lines)[-3000:])


def _servers_of(pid: int) -> list[int]:
    """The temporary Prefect servers (uvicorn) that process ``pid`` started."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmd = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and b"uvicorn" in cmd:
            out.append(int(stat.parent.name))
    return out


@pytest.mark.parametrize(
    ("sig", "group"),
    [(signal.SIGTERM, False), (signal.SIGTERM, True), (signal.SIGINT, True)],
    ids=["SIGTERM-process", "SIGTERM-group", "SIGINT-group"],
)
def test_a_signal_mid_run_ends_the_process_with_one_line(tiny_base, tmp_path, sig, group):
    """A run stopped by SIGTERM (a pool's worker cancelling it, ``timeout``) used to end with status 143 and no word.
    Sent to the whole process group (``timeout``, systemd, a terminal's Ctrl-C), it also stopped the temporary server:
    the run retried it and ended after 146 s with exit 1 and ``internal error: ConnectError``."""
    proc, lines = _started_run(tiny_base, tmp_path, "stopped")
    try:
        os.killpg(proc.pid, sig) if group else proc.send_signal(sig)
        start = time.monotonic()
        lines += proc.stderr.readlines()
        proc.wait(timeout=120)
        took = time.monotonic() - start
    finally:
        with contextlib.suppress(ProcessLookupError):  # a process of the group left over
            os.killpg(proc.pid, signal.SIGKILL)
    errors = [ln for ln in lines if ln.startswith("error: ")]
    assert proc.returncode == (143 if sig == signal.SIGTERM else 130), "".join(lines)[-3000:]
    said = "terminated by SIGTERM" if sig == signal.SIGTERM else "interrupted"
    assert len(errors) == 1 and errors[0].startswith(f"error: {said} — the run stopped"), errors
    assert "Traceback" not in "".join(lines)
    assert took < 60, took


def _running(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie has ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc")
def test_the_temporary_server_ends_with_a_killed_run(tiny_base, tmp_path):
    """The server runs in a session of its own (a signal to the run's group leaves it to finish the run's records);
    it must not outlive a run killed with SIGKILL."""
    proc, _ = _started_run(tiny_base, tmp_path, "killed")
    servers = _servers_of(proc.pid)
    proc.kill()
    proc.wait(timeout=30)
    assert len(servers) == 1, servers
    deadline = time.monotonic() + 30
    while _running(servers[0]) and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = _running(servers[0])
    if alive:
        os.kill(servers[0], signal.SIGKILL)
    assert not alive, "the temporary server outlived the killed run by 30 s"


def test_ctrl_c_before_or_during_the_run_is_one_line(tiny_base, tmp_path, capfd, monkeypatch):
    """A Ctrl-C 12 s into the run (Prefect starting, imports warming) printed a 78-line KeyboardInterrupt traceback."""
    import flows.cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    tiny_config(tiny_base, str(tmp_path / "store"), run_id="ctrl-c", strategies=["simple"]).to_yaml(tmp_path / "r.yaml")
    for where, line in (
        ("check_run", "error: interrupted while the command was starting — nothing was written"),
        (
            "start_ephemeral_server",
            "error: interrupted — the run stopped; what it finished is in the "
            f"store {tmp_path / 'store'}, and the same command resumes from it",
        ),
    ):
        with monkeypatch.context() as m:
            m.setattr(flows.cli, where, interrupted)
            assert main(["--config", str(tmp_path / "r.yaml")]) == 130
        assert capfd.readouterr().err.strip().splitlines() == [line]


STUCK = """
import sys, threading, time
from flows.cli import exit_on_signals
exit_on_signals(grace_s=float(sys.argv[1]))
threading.Thread(target=time.sleep, args=(3600,)).start()  # a task that never reaches its next step
print("ready", flush=True)
try:
    time.sleep(3600)
except KeyboardInterrupt:  # as the command's main catches it
    pass
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize(("grace", "signals"), [(1.0, 1), (600.0, 2)], ids=["grace", "second"])
def test_a_stopped_run_that_hangs_still_ends(sig, grace, signals, tmp_path):
    """A run hung for more than 10 min after SIGTERM or Ctrl-C (running tasks never ended, the server gone): it
    now ends ``grace`` seconds after the signal, or at a second one, with 143 / 130 and a line saying so."""
    root = Path(__file__).resolve().parents[2]
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(root / "src"), str(root)])}
    proc = subprocess.Popen([sys.executable, "-c", STUCK, str(grace)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout.readline().strip() == "ready"
    for _ in range(signals):
        proc.send_signal(sig)
        time.sleep(0.5)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == (143 if sig == signal.SIGTERM else 130), err
    why = f"a second {sig.name}" if signals == 2 else f"the run had not stopped 1 s after {sig.name}"
    assert err.strip().splitlines()[-1] == (
        f"error: {why} — ended without waiting for the running tasks; what the run finished is in the store"
    ), err


def test_drain_events_returns_once_the_server_holds_every_task_run_final():
    from prefect import flow, task
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    @task
    def square(x: int) -> int:
        return x * x

    @flow
    def squares(n: int) -> int:
        return sum(f.result() for f in square.map(range(n)))

    state = squares(12, return_state=True)
    assert state.result() == sum(x * x for x in range(12))
    run_id = state.state_details.flow_run_id
    assert drain_events(run_id, timeout_s=60)
    with get_client(sync_client=True) as client:  # recorded, not merely sent: all 12, each Completed
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))
    assert len(runs) == 12 and all(r.state.is_completed() for r in runs), [(r.name, r.state_type) for r in runs]
    assert drain_events(None) is False  # drain only (a failed run): no waiting


SERVER_ERROR = """
from prefect.logging import get_logger
from prefect.logging.configuration import setup_logging

setup_logging()  # from the environment, as the temporary server's app does
try:
    raise RuntimeError("sqlite3.OperationalError: database is locked")
except RuntimeError:
    get_logger("prefect.server.services.task_run_recorder").exception("Error flushing task run events")
get_logger("prefect.client").error("a client line")
"""


@pytest.mark.parametrize("verbose", [False, True])
def test_the_temporary_server_logs_no_traceback_without_v(verbose, monkeypatch):
    """The run's temporary Prefect server is a child process writing to the same console: under CI load its sqlite
    database logged "database is locked" with a traceback from its event recorder (stop 47's red CI), below the run's
    one error line. A process given the environment the command gives its server keeps that off the console unless -v,
    and still prints the other records."""
    monkeypatch.delenv("PREFECT_SERVER_LOGGING_LEVEL", raising=False)
    quiet_temporary_server(verbose)
    res = subprocess.run([sys.executable, "-c", SERVER_ERROR], env=dict(os.environ), capture_output=True, text=True,
                         timeout=120, check=True)  # fmt: skip
    assert "a client line" in res.stderr
    assert ("Traceback" in res.stderr) is verbose, res.stderr[-2000:]
    assert ("database is locked" in res.stderr) is verbose
