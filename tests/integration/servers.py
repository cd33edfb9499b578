"""Real servers on 127.0.0.1 for tests: a moto S3 server and a Prefect server with process workers.

Both are context managers, usable from any test package (``from tests.integration.servers import ...``); the
fixtures in ``tests/integration/conftest.py`` and ``tests/symfuse/store/conftest.py`` wrap them.

Teardown order matters: workers are stopped BEFORE the server (a worker whose server is gone retries and hangs on
SIGTERM), each with SIGINT first and SIGKILL of its whole process group as the fallback.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

HOST = "127.0.0.1"
PREFECT = [sys.executable, "-m", "prefect"]


def free_port() -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


# --------------------------------------------------------------------------------------------------- moto S3
@dataclass
class S3Server:
    """A running moto S3 server: where it is and how clients reach it."""

    endpoint_url: str
    key: str = "testing"
    secret: str = "testing"
    region: str = "us-east-1"

    @property
    def storage_options(self) -> dict:
        """``ArtifactStore(root, **storage_options)`` keyword arguments for s3fs."""
        return {
            "key": self.key,
            "secret": self.secret,
            "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": self.region},
        }

    @property
    def env(self) -> dict[str, str]:
        """Environment for subprocesses (workers, flow runs): the store finds the endpoint via AWS_ENDPOINT_URL."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.key,
            "AWS_SECRET_ACCESS_KEY": self.secret,
            "AWS_DEFAULT_REGION": self.region,
        }

    def make_bucket(self, name: str | None = None) -> str:
        """Create a bucket (a fresh random name by default) and return its name."""
        import boto3

        name = name or f"symfuse-{uuid.uuid4().hex[:12]}"
        client = boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=self.key,
            aws_secret_access_key=self.secret,
            region_name=self.region,
        )
        client.create_bucket(Bucket=name)
        return name


@contextlib.contextmanager
def moto_s3_server() -> Iterator[S3Server]:
    """A moto S3 server in a thread of this process, on a free port of 127.0.0.1 (s3fs's own test pattern)."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address=HOST, port=port, verbose=False)
    server.start()
    try:
        yield S3Server(endpoint_url=f"http://{HOST}:{port}")
    finally:
        server.stop()


# --------------------------------------------------------------------------------------------------- Prefect
def _stop(proc: subprocess.Popen, grace: float) -> None:
    """SIGINT the process group, then SIGKILL it after ``grace`` seconds."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@dataclass
class PrefectServer:
    """A running ``prefect server start`` with its own PREFECT_HOME and sqlite database.

    Attributes:
        api_url: ``http://127.0.0.1:<port>/api``.
        home: The PREFECT_HOME folder (logs under ``home/logs``).
        env: Environment for Prefect clients, CLI calls and workers (PREFECT_API_URL, PREFECT_HOME, ...).
    """

    api_url: str
    home: Path
    env: dict[str, str]
    _workers: list[subprocess.Popen] = field(default_factory=list)

    def cli(self, *args: str, cwd: str | Path | None = None, timeout: float = 180, check: bool = True):
        """Run ``prefect <args>`` against this server; returns the CompletedProcess (output captured).

        Raises:
            AssertionError: if ``check`` and the command fails (the message holds its output).
        """
        args = tuple(a for a in args if a != "--no-prompt")  # added once below; prefect refuses it twice
        res = subprocess.run(
            [*PREFECT, "--no-prompt", *args],
            cwd=cwd,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and res.returncode != 0:
            raise AssertionError(f"prefect {' '.join(args)} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
        return res

    def start_worker(
        self,
        pool: str = "gpu",
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        name: str = "",
        limit: int | None = None,
        queue: str | None = None,
    ) -> subprocess.Popen:
        """Start ``prefect worker start --pool <pool>`` (a process worker); it is stopped before the server.

        Args:
            pool: Work pool name (must exist, see ``cli("work-pool", "create", ...)``).
            env: Extra environment for the worker and its flow runs (e.g. ``S3Server.env``, CUDA_VISIBLE_DEVICES).
            cwd: Working directory of the worker.
            name: Worker name (default: a random one).
            limit: At most this many flow runs at once on this worker (``--limit``; default: no limit).
            queue: Serve only this work queue of the pool (``--work-queue``; default: every queue).
        """
        log = open(self.home / "logs" / f"worker-{len(self._workers)}.log", "w")  # noqa: SIM115
        args = [*PREFECT, "worker", "start", "--pool", pool, "--type", "process"]
        if name:
            args += ["--name", name]
        if limit is not None:
            args += ["--limit", str(limit)]
        if queue is not None:
            args += ["--work-queue", queue]
        proc = subprocess.Popen(
            args,
            cwd=cwd,
            env={**self.env, **(env or {})},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._workers.append(proc)
        return proc

    def stop_worker(self, proc: subprocess.Popen, grace: float = 20) -> None:
        """Stop one worker started by :meth:`start_worker` (e.g. at the end of a module-scoped fixture)."""
        if proc in self._workers:
            self._workers.remove(proc)
        _stop(proc, grace)

    def stop_workers(self, grace: float = 20) -> None:
        """Stop every worker started here (SIGINT, then SIGKILL of its process group)."""
        while self._workers:
            _stop(self._workers.pop(), grace)

    def log_tail(self, n: int = 60) -> str:
        """The last ``n`` lines of the server's and workers' logs (for assertion messages)."""
        out = []
        for file in sorted((self.home / "logs").glob("*.log")):
            lines = file.read_text(errors="replace").splitlines()[-n:]
            out.append(f"--- {file.name}\n" + "\n".join(lines))
        return "\n".join(out)


def prefect_env(home: Path, api_url: str | None = None) -> dict[str, str]:
    """Environment for a Prefect server or client rooted at ``home`` (sqlite, no UI, no analytics)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        {
            "PREFECT_HOME": str(home),
            "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{home / 'prefect.db'}",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_UI_ENABLED": "false",
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
            "PREFECT_LOGGING_TO_API_BATCH_INTERVAL": "0.3",
            "PYTHONUNBUFFERED": "1",
        }
    )
    if api_url:
        env["PREFECT_API_URL"] = api_url
    return env


def wait_healthy(api_url: str, proc: subprocess.Popen | None = None, timeout: float = 120) -> None:
    """Poll ``<api_url>/health`` until it answers ``true``.

    Raises:
        RuntimeError: if the server process exits or ``timeout`` seconds pass first.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"prefect server exited with {proc.returncode} before becoming healthy")
        with contextlib.suppress(OSError), urllib.request.urlopen(f"{api_url}/health", timeout=2) as resp:
            if resp.status == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"prefect server at {api_url} not healthy after {timeout:.0f} s")


@contextlib.contextmanager
def prefect_server(home: Path, port: int | None = None, timeout: float = 120) -> Iterator[PrefectServer]:
    """Run ``prefect server start --host 127.0.0.1 --port <port>`` with ``home`` as PREFECT_HOME and sqlite.

    Waits for ``/api/health``; on exit stops the workers started through the handle first, then the server.

    Args:
        home: An empty folder (PREFECT_HOME, database, logs).
        port: Port to listen on; a free one by default.
        timeout: Seconds to wait for health (the first start migrates the database: 15-30 s here).
    """
    home = Path(home)
    (home / "logs").mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    api_url = f"http://{HOST}:{port}/api"
    log = open(home / "logs" / "server.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [*PREFECT, "server", "start", "--host", HOST, "--port", str(port)],
        env=prefect_env(home),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    handle = PrefectServer(api_url=api_url, home=home, env=prefect_env(home, api_url))
    try:
        try:
            wait_healthy(api_url, proc, timeout)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}\n{handle.log_tail()}") from exc
        yield handle
    finally:
        handle.stop_workers()
        _stop(proc, grace=20)
        log.close()
