"""What every flow does before composing tasks: forward library logs, apply per-stage timeouts, lock its run id.

* :func:`forward_library_logs`: the ``symfuse.*`` (library) and ``tasks.*`` (retry policy) loggers at INFO, sent to
  the run's logs in the Prefect UI — the programmatic twin of ``PREFECT_LOGGING_EXTRA_LOGGERS=symfuse,tasks``
  (set where flows start: prefect.yaml, stack.py, compose), so it also works in an in-process demo whose Prefect
  logging was set up before that variable could be read.
* :func:`staged`: each task with ``timeout_seconds`` from ``config.timeouts`` (a timeout fails the attempt with a
  ``TimeoutError``, which the retry policy treats as transient). Tasks run in the flow's thread pool, where Prefect
  interrupts Python code (the training / statistics loops, between batches) but not one blocked C call, which
  times out when it returns; Prefect's per-task warning saying so is replaced by one line per flow run.
* :func:`run_lock`: one flow run per ``run_id`` at a time (a Prefect global concurrency limit
  ``symfuse-run-<run_id>`` of one slot): a second run with the same id waits, then reuses what the first stored,
  instead of interleaving writes under ``runs/<run_id>/``.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
import time
from collections.abc import Iterator, Mapping
from types import SimpleNamespace
from typing import Any
from uuid import UUID

from prefect.logging import get_run_logger
from prefect.logging.loggers import PrefectLogAdapter

from symfuse.config import RunConfig

LIBRARY_LOGGERS = ("symfuse", "tasks")
LOCK_PREFIX = "symfuse-run-"
# Seconds a flow waits for another run of the same run_id before failing; None: wait as long as it takes.
LOCK_WAIT_SECONDS: float | None = None
# Lease on the run lock's slot (the server frees it this long after its holder died; Prefect allows 60 s to 1 day),
# renewed every RENEW_EVERY_SECONDS; a waiting run asks again at most every ACQUIRE_POLL_SECONDS.
LEASE_SECONDS = 300.0
RENEW_EVERY_SECONDS = 60.0
ACQUIRE_POLL_SECONDS = 5.0
# Run ids whose lock this context (a flow run and its subflows, e.g. remerge -> fusion_pipeline) already holds.
_HELD: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar("symfuse_run_locks", default=frozenset())


class _ThreadTimeoutNotice(logging.Filter):
    """Drops Prefect's per-task "timeout in a worker thread" warning (said once per flow run instead)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Timeout of %s seconds configured for this task, but the task is")


def forward_library_logs(names: tuple[str, ...] = LIBRARY_LOGGERS, level: int = logging.INFO) -> None:
    """Send INFO lines of the ``names`` loggers to the current run's logs (Prefect's API handler); idempotent.

    Without this only ``prefect.*`` loggers reach the UI, and the library's per-epoch losses, OOM halving and
    "not retrying" lines appear nowhere: ``PREFECT_LOGGING_EXTRA_LOGGERS`` attaches the API handler but leaves the
    loggers at the root's WARNING level. A logger that has no API handler yet gets one that only sends records made
    inside a flow or task run (library calls outside a run, e.g. in tests, are not sent and raise no warning).
    """
    from prefect.logging.handlers import APILogHandler

    task_log = logging.getLogger("prefect.task_runs")
    if not any(isinstance(f, _ThreadTimeoutNotice) for f in task_log.filters):
        task_log.addFilter(_ThreadTimeoutNotice())
    for name in names:
        log = logging.getLogger(name)
        if log.level == logging.NOTSET or log.level > level:
            log.setLevel(level)
        if not any(isinstance(h, APILogHandler) for h in log.handlers):
            log.addHandler(_run_log_handler())


def _run_log_handler() -> logging.Handler:
    """Prefect's API log handler, sending only records made inside a flow or task run."""
    from prefect.context import FlowRunContext, TaskRunContext
    from prefect.logging.handlers import APILogHandler

    class RunLogHandler(APILogHandler):
        def emit(self, record: logging.LogRecord) -> None:
            if FlowRunContext.get() or TaskRunContext.get() or getattr(record, "flow_run_id", None):
                super().emit(record)

    return RunLogHandler()


def staged(config: RunConfig, stages: Mapping[Any, str]) -> SimpleNamespace:
    """Each task of ``stages`` (task -> stage name) with ``timeout_seconds`` of its stage in ``config.timeouts``.

    Returns:
        A namespace with one attribute per task, named after its function (``T.finetune``, ``T.merge`` ...).
    """
    limits = config.timeouts.model_dump()
    unknown = sorted(set(stages.values()) - set(limits))
    if unknown:
        raise ValueError(f"no timeout setting for stage(s) {unknown}; RunConfig.timeouts has {sorted(limits)}")
    _logger().info(
        "task time limits (s): %s; a task in the thread pool is stopped at its next Python step after its limit, "
        "then retried", limits,
    )  # fmt: skip
    return SimpleNamespace(
        **{task.fn.__name__: task.with_options(timeout_seconds=limits[stage]) for task, stage in stages.items()}
    )


@contextlib.contextmanager
def run_lock(run_id: str, wait_seconds: float | None = None) -> Iterator[None]:
    """Hold the ``symfuse-run-<run_id>`` concurrency slot (limit 1, created if missing) for the block.

    Re-entrant within one flow run (a subflow of the holder passes through). Every call talks to the server of the
    CURRENT settings (Prefect's ``concurrency()`` keeps one acquisition service per limit name for the process, bound
    to whichever server it first saw: a process that later points at another server got leases there that this
    server does not know, ``410 Gone`` on renewal, then a wait that never ends). A lease the server lost or revoked
    while the block runs is taken again when free, and otherwise only logged: the block's writes are content-keyed
    and atomic, so finishing is safer than cancelling a pipeline half-way. A holder that dies frees the slot when its
    lease expires (:data:`LEASE_SECONDS`).

    Args:
        run_id: The run id whose store prefix ``runs/<run_id>/`` the block writes.
        wait_seconds: Give up after this many seconds (default :data:`LOCK_WAIT_SECONDS`).

    Raises:
        RuntimeError: if another flow run kept the run id for ``wait_seconds`` (names the limit and the fix).
    """
    if run_id in _HELD.get():
        yield
        return
    from prefect.client.orchestration import get_client

    name = f"{LOCK_PREFIX}{run_id}"
    wait = LOCK_WAIT_SECONDS if wait_seconds is None else wait_seconds
    log = _logger()
    log.info("taking run lock %s (one flow run per run_id at a time)", name)
    with get_client(sync_client=True) as client:
        _ensure_limit(client, name)
        lease_id = _acquire(client, name, wait, log)
    if lease_id is None:
        raise RuntimeError(
            f"run_id {run_id!r} is in use by another flow run (concurrency limit {name} busy for {wait} s): wait for "
            f"it to finish, or start this run with another run_id"
        )
    keeper = _LeaseKeeper(name, lease_id, log)
    keeper.start()
    token = _HELD.set(_HELD.get() | {run_id})
    try:
        yield
    finally:
        _HELD.reset(token)
        keeper.stop_and_release()


def _ensure_limit(client: Any, name: str) -> None:
    """Create the one-slot global concurrency limit ``name`` unless it exists."""
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    try:
        client.read_global_concurrency_limit_by_name(name)
    except ObjectNotFound:
        with contextlib.suppress(ObjectAlreadyExists):  # another run created it meanwhile
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))


def _holder() -> Any:
    """The lease holder shown by the server: the current flow run, if any."""
    from prefect.client.schemas.objects import ConcurrencyLeaseHolder
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    return ConcurrencyLeaseHolder(type="flow_run", id=ctx.flow_run.id) if ctx and ctx.flow_run else None


def _acquire(client: Any, name: str, wait: float | None, log: Any) -> Any:
    """A lease on the one slot of ``name``, waiting up to ``wait`` seconds (None: no limit); None when busy."""
    import httpx

    deadline = None if wait is None else time.monotonic() + wait
    said = False
    while True:
        try:
            response = client.increment_concurrency_slots_with_lease(
                names=[name], slots=1, mode="concurrency", lease_duration=LEASE_SECONDS, holder=_holder()
            )
            return UUID(response.json()["lease_id"])
        except httpx.HTTPStatusError as exc:
            if exc.response.status_code != 423:  # 423 Locked: held by another run
                raise
            retry = float(exc.response.headers.get("Retry-After", 1.0))
        if not said:
            log.info("run lock %s is held by another flow run; waiting for it", name)
            said = True
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            retry = min(retry, left)
        time.sleep(min(max(retry, 0.1), ACQUIRE_POLL_SECONDS))


class _LeaseKeeper:
    """Renews a run-lock lease from a daemon thread; takes the slot again if the server lost the lease."""

    def __init__(self, name: str, lease_id: Any, log: Any) -> None:
        self.name, self.lease_id, self.log = name, lease_id, log
        self._stop = threading.Event()
        self._context = contextvars.copy_context()  # the caller's Prefect settings (API URL) and logging context
        self._thread = threading.Thread(target=self._context.run, args=(self._loop,), daemon=True, name=name)

    def start(self) -> None:
        self._thread.start()

    def _loop(self) -> None:
        from prefect.client.orchestration import get_client

        while not self._stop.wait(RENEW_EVERY_SECONDS):
            try:
                with get_client(sync_client=True) as client:
                    self._renew(client)
            except Exception as exc:  # a renewal error must never stop the run
                self.log.warning("run lock %s: lease renewal failed (%s); retrying", self.name, _short(exc))

    def _renew(self, client: Any) -> None:
        import httpx

        if self.lease_id is not None:
            try:
                client.renew_concurrency_lease(self.lease_id, lease_duration=LEASE_SECONDS)
                return
            except httpx.HTTPStatusError as exc:
                if exc.response.status_code not in (404, 410):
                    raise
            self.log.warning("run lock %s: the server lost this run's lease; taking the slot again", self.name)
            self.lease_id = None
        self.lease_id = _acquire(client, self.name, 0, self.log)
        if self.lease_id is None:
            self.log.warning("run lock %s: another flow run holds the slot now; this run goes on", self.name)

    def stop_and_release(self) -> None:
        """Stop renewing and give the slot back (a lease the server no longer knows is already free)."""
        from prefect.client.orchestration import get_client

        self._stop.set()
        self._thread.join(timeout=30)
        if self.lease_id is None:
            return
        try:
            with get_client(sync_client=True) as client:
                client.release_concurrency_slots_with_lease(self.lease_id)
        except Exception as exc:  # the lease expires on its own
            self.log.warning("run lock %s: release failed (%s); freed when its lease expires", self.name, _short(exc))


def _short(exc: BaseException) -> str:
    """One line for an HTTP or other error (status and reason, no body or headers)."""
    response = getattr(exc, "response", None)
    if response is not None:
        return f"HTTP {response.status_code} {response.reason_phrase}"
    return f"{type(exc).__name__}: {exc}".splitlines()[0]


def _logger() -> logging.Logger | PrefectLogAdapter:
    """The run logger inside a flow run, else this module's logger."""
    from prefect.exceptions import MissingContextError

    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("flows")
