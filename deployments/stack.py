"""A local Prefect stack for symfuse: server on 127.0.0.1, pools, deployments, automations, workers.

Usage (from anywhere; paths are resolved against the repository)::

    python deployments/stack.py start [--port 4200] [--gpus 0,1] [--home DIR] [--force]   # or local_stack.sh
    python deployments/stack.py status
    python deployments/stack.py stop                                           # workers first, then the server
    python deployments/stack.py automations                                    # (re)apply automations.yaml
    python deployments/stack.py setup [--force]   # against $PREFECT_API_URL: pools, limit, automations, deploy

``start`` runs ``prefect server start --host 127.0.0.1 --port PORT`` in the background (its UI calls the API on
that same port: PREFECT_UI_API_URL and PREFECT_API_URL are set from ``--port``; PREFECT_HOME and its sqlite database
under ``--home``, default ``$SYMFUSE_STACK_DIR`` or ``symfuse-runs/.stack``), creates the process work pools ``gpu``
and ``control`` (the watcher's, so it never takes a GPU worker's slot) and the ``gpu`` pool's queue ``stages``, runs
``prefect deploy`` on a copy of ``deployments/prefect.yaml`` whose pull step names this checkout (the file itself
names /opt/symfuse, the images' folder) for the deployments that are new or changed in the file since the last deploy
(``deployments/stack_deploy.py``: edits made in the UI are kept and named; ``--force`` deploys everything as the file
says), applies ``deployments/automations.yaml`` and starts the workers (:func:`worker_specs`): one for pipelines
(queue ``default``), one stage worker per GPU with ``CUDA_VISIBLE_DEVICES`` set to it and ``--limit 1`` (one with
``--limit $SYMFUSE_CPU_SLOTS`` when there is no GPU), all naming this machine in ``SYMFUSE_DEVICE_SLOTS`` (a heavy
task holds one of its devices: ``tasks/devices.py``), plus one ``control`` worker. Workers inherit this shell's
environment: set ``SYMFUSE_STORE`` (and ``AWS_*``
for an ``s3://`` store) before starting; ``HF_HUB_OFFLINE=1`` there forbids hub downloads (not forced here).

``stop`` stops the workers BEFORE the server: a worker whose server is gone retries and hangs on SIGTERM. ``start``
right after ``stop`` works: the port check accepts the connections the old server left in TIME_WAIT (the new
server's socket uses SO_REUSEADDR too). ``start`` also removes scratch folders of killed processes
(:mod:`symfuse.scratch`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))  # deployments/ is no package: its sibling module
import stack_deploy as redeploy

REPO = Path(__file__).resolve().parent.parent
PREFECT_FILE = REPO / "deployments" / "prefect.yaml"
AUTOMATIONS_FILE = REPO / "deployments" / "automations.yaml"
POOL = "gpu"
CONTROL_POOL = "control"
GPU_TAG = "gpu"  # tasks on the accelerator carry it; no limit on it (device slots, tasks/devices.py, bound them)
STAGE_QUEUE = "stages"
LIBRARY_LOGGERS = "symfuse,tasks"  # PREFECT_LOGGING_EXTRA_LOGGERS: library INFO lines in the runs' logs
HOST = "127.0.0.1"


def stack_home(home: str | os.PathLike | None = None) -> Path:
    """Folder holding the stack's PREFECT_HOME, database, pid files and logs."""
    return Path(home or os.environ.get("SYMFUSE_STACK_DIR") or REPO / "symfuse-runs" / ".stack").resolve()


def server_env(home: Path, api_url: str | None = None) -> dict[str, str]:
    """Environment of the server, the CLI calls and the workers (PREFECT_HOME and sqlite under ``home``)."""
    env = dict(os.environ)
    env.update(
        {
            "PREFECT_HOME": str(home / "prefect"),
            "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{home / 'prefect' / 'prefect.db'}",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
        }
    )
    env.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", LIBRARY_LOGGERS)
    if api_url:
        env["PREFECT_API_URL"] = api_url
        env["PREFECT_UI_API_URL"] = api_url  # the UI calls this API (else it follows the default port 4200)
    return env


def port_free(host: str, port: int) -> bool:
    """Whether a server could listen on ``host:port`` now.

    The test bind uses SO_REUSEADDR like the server's own socket, so connections a stopped server left in
    TIME_WAIT do not count as taken (``start`` right after ``stop`` works); a listening socket does.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_pids(home: Path, pattern: str) -> list[tuple[Path, int]]:
    out = []
    for file in sorted(home.glob(pattern)):
        with contextlib.suppress(ValueError):
            out.append((file, int(file.read_text().strip())))
    return out


def _spawn(args: Sequence[str], env: dict[str, str], log: Path, pid_file: Path) -> int:
    """Start a detached process (own session, so its whole group can be signalled); record its pid."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            list(args), cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    pid_file.write_text(str(proc.pid))
    return proc.pid


def _terminate(pid: int, first: signal.Signals, grace: float) -> None:
    """Signal a process group, wait ``grace`` seconds, then SIGKILL it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, first)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.2)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
    if _alive(pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


def wait_healthy(api_url: str, timeout: float = 120, pid: int | None = None) -> None:
    """Poll ``<api_url>/health`` until it answers.

    Args:
        api_url: The server's API URL.
        timeout: Seconds to wait.
        pid: The server process started here (a child): give up at once if it exits.

    Raises:
        TimeoutError: if it does not answer within ``timeout`` seconds.
        RuntimeError: if the process ``pid`` exited.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pid is not None:
            with contextlib.suppress(ChildProcessError):
                done, code = os.waitpid(pid, os.WNOHANG)
                if done:
                    raise RuntimeError(f"prefect server (pid {pid}) exited with status {code} before answering")
        with contextlib.suppress(OSError), urllib.request.urlopen(f"{api_url}/health", timeout=2) as resp:
            if resp.status == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"prefect server at {api_url} not healthy after {timeout:.0f} s")


# ----------------------------------------------------------------------------------------------- API set-up
async def _setup_api(api_url: str, automations: list[dict[str, Any]]) -> None:
    """Create the process pools, the stage queue and the automations (replacing same-named ones).

    A ``gpu`` tag concurrency limit left by an older set-up is deleted: one global limit serialised every heavy
    task over all machines (device slots per machine replace it).
    """
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.events.schemas.automations import AutomationCore
    from prefect.exceptions import ObjectNotFound
    from prefect.workers.process import ProcessWorker

    async with get_client() as client:
        for pool in (POOL, CONTROL_POOL):
            try:
                await client.read_work_pool(pool)
            except ObjectNotFound:
                template = ProcessWorker.get_default_base_job_template()
                await client.create_work_pool(WorkPoolCreate(name=pool, type="process", base_job_template=template))
        with contextlib.suppress(ObjectNotFound):
            await client.delete_concurrency_limit_by_tag(GPU_TAG)
        if STAGE_QUEUE not in {q.name for q in await client.read_work_queues(work_pool_name=POOL)}:
            await client.create_work_queue(name=STAGE_QUEUE, work_pool_name=POOL)
        for data in automations:
            automation = AutomationCore.model_validate(data)
            for old in await client.read_automations_by_name(automation.name):
                await client.delete_automation(old.id)
            await client.create_automation(automation)


def load_automations(path: Path = AUTOMATIONS_FILE) -> list[dict[str, Any]]:
    """The automations of ``automations.yaml`` (a mapping with ``automations:`` or a list)."""
    data = yaml.safe_load(path.read_text())
    return data["automations"] if isinstance(data, dict) else list(data)


def apply_api_setup(api_url: str, automations: list[dict[str, Any]] | None = None) -> None:
    """Pools ``gpu`` (queues default, stages) and ``control`` (process), automations: against ``api_url``."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: api_url}):
        asyncio.run(_setup_api(api_url, load_automations() if automations is None else automations))


def deployable_names(prefect_file: Path = PREFECT_FILE) -> tuple[list[str], list[str]]:
    """Deployment names whose entrypoint file exists in the checkout, and those whose file is missing."""
    data = yaml.safe_load(prefect_file.read_text())
    ok, missing = [], []
    for dep in data.get("deployments") or []:
        file = dep["entrypoint"].split(":", 1)[0]
        (ok if (REPO / file).is_file() else missing).append(dep["name"])
    return ok, missing


def local_project_file(home: Path, checkout: Path = REPO, prefect_file: Path = PREFECT_FILE) -> Path:
    """A copy of ``prefect_file`` under ``home`` whose pull step runs the flows in ``checkout`` (the local stack)."""
    data = yaml.safe_load(prefect_file.read_text())
    data["pull"] = [{"prefect.deployments.steps.set_working_directory": {"directory": str(checkout)}}]
    out = home / "prefect.yaml"
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return out


def deploy(env: dict[str, str], prefect_file: Path = PREFECT_FILE, force: bool = False) -> dict[str, Any]:
    """``prefect deploy`` the deployments of ``prefect_file`` that are new or changed (see ``stack_deploy.py``).

    Args:
        env: Environment of the ``prefect deploy`` call; its ``PREFECT_API_URL`` names the server.
        prefect_file: The project file (deployments whose entrypoint file is missing are skipped).
        force: Deploy every deployment as the file defines it, resetting what was edited on the server.

    Returns:
        ``deployed`` / ``unchanged`` / ``kept``: deployment names; ``lines``: one line per deployment saying why.

    Raises:
        RuntimeError: if ``prefect deploy`` fails (its output is in the message).
    """
    from prefect.settings import PREFECT_API_URL, temporary_settings

    names, missing = deployable_names(prefect_file)
    out: dict[str, Any] = {"deployed": [], "unchanged": [], "kept": [], "lines": []}
    if missing:
        out["lines"].append(f"skipping deployments whose entrypoint file is missing: {', '.join(missing)}")
    if not names:
        return out
    data = yaml.safe_load(prefect_file.read_text())
    entries = {d["name"]: d for d in data["deployments"] if d["name"] in names}
    files = {n: redeploy.file_view(entries[n], data.get("pull")) for n in names}
    flows = {n: redeploy.flow_name(entries[n]["entrypoint"], REPO) for n in names}
    with temporary_settings(updates={PREFECT_API_URL: env["PREFECT_API_URL"]}):
        views, records = asyncio.run(redeploy.read_server(flows))
        decisions = [redeploy.plan(n, files[n], views[n], records[n], force) for n in names]
        todo = [d.name for d in decisions if d.action == "deploy"]
        if todo:
            args = [sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--prefect-file", str(prefect_file)]
            for name in todo:
                args += ["--name", name]
            res = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, check=False)
            if res.returncode != 0:
                raise RuntimeError(f"prefect deploy failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
        asyncio.run(redeploy.finish(flows, decisions, files))
    for d in decisions:
        out[d.action if d.action != "deploy" else "deployed"].append(d.name)
        out["lines"].append(d.line)
    return out


def detect_gpus() -> list[str]:
    """GPU indices to start workers for: ``$CUDA_VISIBLE_DEVICES`` if set, else what torch sees (none: [])."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [g for g in visible.split(",") if g.strip()]
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        return []


def worker_specs(gpus: Sequence[str], machine: str, cpu_slots: int = 1) -> list[tuple[str, list[str], dict[str, str]]]:
    """``(name, worker arguments, extra environment)`` of the ``gpu`` pool's workers on this machine.

    One pipeline worker (queue ``default``, every GPU visible, no limit: pipelines mostly wait on their stages) and
    the stage workers (queue ``stages``): one per GPU with ``CUDA_VISIBLE_DEVICES`` and ``--limit 1``, or one CPU
    worker with ``--limit cpu_slots``. All name ``machine`` in ``SYMFUSE_DEVICE_SLOTS``: their heavy tasks share the
    machine's device slots.
    """
    base = ["--pool", POOL, "--type", "process"]
    slots = {"SYMFUSE_DEVICE_SLOTS": machine}
    specs = [(f"{POOL}-worker-{machine}", [*base, "--work-queue", "default"], dict(slots))]
    for gpu in gpus:
        specs.append((f"{POOL}-stages-{machine}-gpu{gpu}", [*base, "--work-queue", STAGE_QUEUE, "--limit", "1"],
                      {**slots, "CUDA_VISIBLE_DEVICES": gpu}))  # fmt: skip
    if not gpus:
        specs.append((f"{POOL}-stages-{machine}-cpu", [*base, "--work-queue", STAGE_QUEUE, "--limit", str(cpu_slots)],
                      {**slots, "SYMFUSE_CPU_SLOTS": str(cpu_slots)}))  # fmt: skip
    return specs


# ----------------------------------------------------------------------------------------------- commands
def start(
    port: int = 4200,
    gpus: Sequence[str] | None = None,
    home: str | os.PathLike | None = None,
    workers: bool = True,
    force: bool = False,
) -> dict:
    """Start server, pool, limit, deployments, automations and workers; returns what it started.

    Args:
        port: Server port on 127.0.0.1.
        gpus: GPU indices, one worker each (default :func:`detect_gpus`; empty: one worker without a GPU).
        home: Stack folder (default :func:`stack_home`).
        workers: Start the workers (False: runs stay Scheduled until a worker joins the pool).
        force: Deploy every deployment as ``prefect.yaml`` says (default: only new or changed ones, UI edits kept).

    Raises:
        RuntimeError: if a stack already runs under ``home`` or a step fails (the stack is stopped again).
    """
    root = stack_home(home)
    (root / "logs").mkdir(parents=True, exist_ok=True)
    (root / "prefect").mkdir(parents=True, exist_ok=True)
    running = [pid for _, pid in _read_pids(root, "*.pid") if _alive(pid)]
    if running:
        raise RuntimeError(f"a stack already runs under {root} (pids {running}); stop it first")
    if not port_free(HOST, port):
        raise RuntimeError(f"port {port} on {HOST} is taken: pass --port or stop what listens there")
    from symfuse.scratch import clean_stale_scratch

    for folder in clean_stale_scratch():
        print(f"removed scratch folder of a killed process: {folder}")
    api_url = f"http://{HOST}:{port}/api"
    env = server_env(root, api_url)
    server_pid = _spawn(
        [sys.executable, "-m", "prefect", "server", "start", "--host", HOST, "--port", str(port)],
        {**env, "PREFECT_SERVER_API_HOST": HOST, "PREFECT_SERVER_API_PORT": str(port)},
        root / "logs" / "server.log",
        root / "server.pid",
    )
    try:
        try:
            wait_healthy(api_url, pid=server_pid)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}; see {root / 'logs' / 'server.log'}") from exc
        gpus = detect_gpus() if gpus is None else list(gpus)
        apply_api_setup(api_url)
        deployed = deploy(env, local_project_file(root), force=force)
        pids = []
        cpu_slots = int(os.environ.get("SYMFUSE_CPU_SLOTS", "1"))
        for i, (name, args, extra) in enumerate(worker_specs(gpus, socket.gethostname(), cpu_slots) if workers else []):
            command = [sys.executable, "-m", "prefect", "worker", "start", *args, "--name", name]
            log = root / "logs" / f"{name}.log"
            pids.append(_spawn(command, {**env, **extra}, log, root / f"worker-{i}.pid"))
        if workers:  # the watcher's pool: listing the store needs no GPU
            args = [sys.executable, "-m", "prefect", "worker", "start", "--pool", CONTROL_POOL, "--type", "process"]
            name = f"{CONTROL_POOL}-worker"
            log = root / "logs" / f"{name}.log"
            pids.append(_spawn([*args, "--name", name], env, log, root / "worker-control.pid"))
    except BaseException:
        stop(root)
        raise
    info = {"api_url": api_url, "ui": api_url[: -len("/api")], "home": str(root), "server_pid": server_pid,
            "worker_pids": pids, "deployments": deployed["deployed"], "deploy": deployed}  # fmt: skip
    (root / "stack.json").write_text(json.dumps(info, indent=1))
    return info


def stop(home: str | os.PathLike | None = None, grace: float = 20) -> list[int]:
    """Stop the workers (SIGINT, then SIGKILL), THEN the server; returns the pids stopped."""
    root = stack_home(home)
    stopped = []
    for file, pid in _read_pids(root, "worker-*.pid"):
        if _alive(pid):
            _terminate(pid, signal.SIGINT, grace)
            stopped.append(pid)
        file.unlink(missing_ok=True)
    for file, pid in _read_pids(root, "server.pid"):
        if _alive(pid):
            _terminate(pid, signal.SIGTERM, grace)
            stopped.append(pid)
        file.unlink(missing_ok=True)
    return stopped


def status(home: str | os.PathLike | None = None) -> dict[str, bool]:
    """Which stack processes run: pid file name -> alive."""
    return {file.stem: _alive(pid) for file, pid in _read_pids(stack_home(home), "*.pid")}


def main(argv: Sequence[str] | None = None) -> int:
    """Command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["start", "stop", "status", "automations", "setup"])
    parser.add_argument("--port", type=int, default=int(os.environ.get("SYMFUSE_PREFECT_PORT", "4200")))
    parser.add_argument("--gpus", default=None, help="comma-separated GPU indices (default: all visible)")
    parser.add_argument("--home", default=None, help="stack folder (default $SYMFUSE_STACK_DIR or symfuse-runs/.stack)")
    parser.add_argument("--no-workers", action="store_true", help="start no worker (runs wait in the pool)")
    parser.add_argument("--force", action="store_true", help="deploy every deployment as prefect.yaml says, "
                        "resetting edits made in the UI (default: only new or changed ones)")  # fmt: skip
    args = parser.parse_args(argv)
    if problem := option_problem(args.port, args.gpus, args.home):
        parser.error(problem)  # one line, exit 2
    try:
        return _run(args)
    except (RuntimeError, OSError) as exc:  # a stack already running, a port taken, a failed step: one line
        print(f"error: {exc}", file=sys.stderr)
        return 1


def option_problem(port: int, gpus: str | None, home: str | None) -> str | None:
    """Why the options cannot start a stack, or None (checked before anything starts).

    A port past 65535 was a traceback and port 0 a hang; ``--gpus a`` started a worker for a GPU that is not there
    (its tasks then ran on the CPU); ``--home`` naming a file was a traceback.
    """
    if not 0 < port < 65536:
        return f"--port {port}: not a TCP port — give one from 1 to 65535"
    if gpus is not None:
        given = [g.strip() for g in gpus.split(",") if g.strip()]
        bad = [g for g in given if not (g.isdigit() or g.startswith(("GPU-", "MIG-")))]
        if bad or len(set(given)) < len(given):
            what = f"{bad} are not GPU indices or UUIDs" if bad else "a GPU is named twice"
            return f"--gpus {gpus}: {what} — give distinct indices such as 0,1 (nvidia-smi -L lists them)"
        seen = detect_gpus()
        missing = [g for g in given if g.isdigit() and g not in seen]
        if missing:
            return (f"--gpus {gpus}: GPU {', '.join(missing)} not visible here (visible: {', '.join(seen) or 'none'}) "
                    "— name visible GPUs, or leave --gpus out (every visible GPU; none: one CPU worker)")  # fmt: skip
    root = stack_home(home)
    blocker = next((p for p in (root, *root.parents) if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        return f"--home {root}: {blocker} is a file — give a folder (created if missing)"
    return None


def _run(args: argparse.Namespace) -> int:
    if args.command == "start":
        gpus = None if args.gpus is None else [g.strip() for g in args.gpus.split(",") if g.strip()]
        info = start(args.port, gpus, args.home, workers=not args.no_workers, force=args.force)
        print(f"Prefect UI: {info['ui']}   API: {info['api_url']}")
        print("\n".join(info["deploy"]["lines"]))
        print(f"workers: {info['worker_pids']}")
        print(f"use it with: export PREFECT_API_URL={info['api_url']}; stop with: {sys.argv[0]} stop")
    elif args.command == "stop":
        print(f"stopped: {stop(args.home) or 'nothing was running'}")
    elif args.command == "status":
        print(json.dumps(status(args.home), indent=1))
    else:  # automations / setup: against a server that runs already (docker compose, a remote server)
        api_url = os.environ.get("PREFECT_API_URL") or f"http://{HOST}:{args.port}/api"
        wait_healthy(api_url)
        apply_api_setup(api_url)
        print(f"pools {POOL!r} (queues default, {STAGE_QUEUE}) and {CONTROL_POOL!r}, {AUTOMATIONS_FILE.name} "
              f"applied to {api_url}")  # fmt: skip
        if args.command == "setup":
            env = {**os.environ, "PREFECT_API_URL": api_url}
            print("\n".join(deploy(env, force=args.force)["lines"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
