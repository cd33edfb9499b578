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
  instead of interleaving writes under ``runs/<run_id>/``. The holder (flow run id, attempt, lease) is recorded in a
  Prefect variable, with a beat the holder counts up at every renewal: a LATER ATTEMPT of the same flow run (a crashed
  run rescheduled) takes the lock over as soon as that beat stood still for 30 s, a different flow run waits until the
  holder releases it or its one-minute lease runs out (holder died).
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
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
from tasks.devices import ensure_limit

LIBRARY_LOGGERS = ("symfuse", "tasks")
LOCK_PREFIX = "symfuse-run-"
# Seconds a flow waits for another run of the same run_id before failing; None: wait as long as it takes.
LOCK_WAIT_SECONDS: float | None = None
# Lease on the run lock's slot (the server frees it this long after its holder died, plus up to 15 s of its expiry
# loop; Prefect allows 60 s to 1 day), renewed every RENEW_EVERY_SECONDS; a waiting run asks again at most every
# ACQUIRE_POLL_SECONDS.
LEASE_SECONDS = 60.0
RENEW_EVERY_SECONDS = 5.0
ACQUIRE_POLL_SECONDS = 5.0
# Prefect variable recording a run lock's holder: {"flow_run": id, "attempt": run_count, "lease": lease id, "beat": n},
# "beat" counted up at every renewal. A later attempt of the holder's flow run takes the lock over once the record
# stood still for QUIET_SECONDS by the server's clock (six missed beats: the earlier attempt is dead, not just slow).
HOLDER_PREFIX = "symfuse-run-lock-"
QUIET_SECONDS = 30.0
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
        A namespace with one attribute per task, named after its function (``T.finetune``, ``T.merge`` ...), and
        ``stages`` (``stages`` as given: :func:`flows.failures.raise_failure` names a timed-out task's setting from it).
    """
    limits = config.timeouts.model_dump()
    unknown = sorted(set(stages.values()) - set(limits))
    if unknown:
        raise ValueError(f"no timeout setting for stage(s) {unknown}; RunConfig.timeouts has {sorted(limits)}")
    _logger().info(
        "task time limits (s): %s; a task in the thread pool is stopped at its next Python step after its limit, "
        "then retried", limits,
    )  # fmt: skip
    tasks = {task.fn.__name__: task.with_options(timeout_seconds=limits[stage]) for task, stage in stages.items()}
    return SimpleNamespace(**tasks, stages=dict(stages))


@contextlib.contextmanager
def run_lock(run_id: str, wait_seconds: float | None = None) -> Iterator[None]:
    """Hold the ``symfuse-run-<run_id>`` concurrency slot (limit 1, created if missing) for the block.

    Re-entrant within one flow run (a subflow of the holder passes through). Every call talks to the server of the
    CURRENT settings (Prefect's ``concurrency()`` keeps one acquisition service per limit name for the process, bound
    to whichever server it first saw: a process that later points at another server got leases there that this
    server does not know, ``410 Gone`` on renewal, then a wait that never ends). A lease the server lost or revoked
    while the block runs is taken again when free, and otherwise only logged: the block's writes are content-keyed
    and atomic, so finishing is safer than cancelling a pipeline half-way. A holder that dies frees the slot when its
    lease expires (:data:`LEASE_SECONDS`); one whose recorded beat stopped longer ago than that is taken over (a
    server started for one command forgets its leases, not the slot: see :func:`_free_expired`).

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
        ensure_limit(client, name)
        lease_id = _acquire(client, name, wait, log, _attempt(client))
    if lease_id is None:
        raise RuntimeError(
            f"run_id {run_id!r} is in use by another flow run (concurrency limit {name} busy for {wait} s): wait for "
            f"it to finish, or start this run with another run_id"
        )
    keeper = _LeaseKeeper(name, lease_id, log, _ATTEMPT.get())
    keeper.start()
    token = _HELD.set(_HELD.get() | {run_id})
    try:
        yield
    finally:
        _HELD.reset(token)
        keeper.stop_and_release()


def _holder() -> Any:
    """The lease holder shown by the server: the current flow run, if any."""
    from prefect.client.schemas.objects import ConcurrencyLeaseHolder
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    return ConcurrencyLeaseHolder(type="flow_run", id=ctx.flow_run.id) if ctx and ctx.flow_run else None


def holder_variable(name: str) -> str:
    """Name of the Prefect variable recording who holds the run lock ``name`` (lowercase, dashes: a valid name)."""
    return HOLDER_PREFIX + hashlib.sha256(name.encode()).hexdigest()[:24]


def takes_over(holder: Mapping[str, Any] | None, me: Mapping[str, Any] | None) -> bool:
    """Whether attempt ``me`` may take the lock from ``holder``: an EARLIER attempt of the same flow run.

    An earlier attempt still holding the lock when a later one starts was lost (its process or machine died and the
    run was rescheduled), or is a duplicate Prefect started next to the new one (a worker reporting one crash twice
    reschedules the run twice): :func:`_acquire` takes over only once the holder's beat stood still for
    :data:`QUIET_SECONDS`, so a live duplicate finishes first. Any other holder (another flow run, or no record) is
    waited for until it releases the slot or its lease runs out.

    Args:
        holder: The recorded holder ``{"flow_run", "attempt", "lease"}``, or None.
        me: The current attempt ``{"flow_run", "attempt"}``, or None outside a flow run.
    """
    if not holder or not me:
        return False
    try:
        return str(holder["flow_run"]) == str(me["flow_run"]) and int(holder["attempt"]) < int(me["attempt"])
    except (KeyError, TypeError, ValueError):  # a record written by something else: not ours to take
        return False


_ATTEMPT: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("symfuse_attempt", default=None)


def _attempt(client: Any) -> dict[str, Any] | None:
    """The current flow run and its attempt (``run_count`` as the server counts it now), None outside a flow run."""
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    if ctx is None or ctx.flow_run is None:
        _ATTEMPT.set(None)
        return None
    try:
        count = client.read_flow_run(ctx.flow_run.id).run_count
    except Exception:  # the context's own count (read when the process started) is the fallback
        count = ctx.flow_run.run_count
    me = {"flow_run": str(ctx.flow_run.id), "attempt": max(1, int(count or 1))}
    _ATTEMPT.set(me)
    return me


def _read_holder(client: Any, name: str) -> dict[str, Any] | None:
    """The recorded holder of ``name`` (None if unrecorded or unreadable)."""
    return _read_holder_and_age(client, name)[0]


def _read_holder_and_age(client: Any, name: str) -> tuple[dict[str, Any] | None, float]:
    """The recorded holder of ``name`` and how many seconds ago it was last written, by the server's clock.

    The age is the server's ``Date`` header minus the variable's ``updated`` (both server time: no clock skew
    between machines); 0 when either is unknown.
    """
    from email.utils import parsedate_to_datetime

    try:
        variable = client.read_variable_by_name(holder_variable(name))
    except Exception:
        return None, 0.0
    value = getattr(variable, "value", None)
    if not isinstance(value, dict):
        return None, 0.0
    try:
        now = parsedate_to_datetime(client.request("GET", "/health").headers["date"])
        return value, max(0.0, (now - variable.updated).total_seconds())
    except Exception:
        return value, 0.0


def _record_holder(
    client: Any, name: str, lease_id: UUID, me: Mapping[str, Any] | None, log: Any, beat: int = 0
) -> None:
    """Record ``me`` (with ``lease_id`` and ``beat``) as the holder of ``name``; a failure only delays takeovers."""
    from prefect.client.schemas.actions import VariableCreate, VariableUpdate

    if me is None:
        return
    value, var = {**me, "lease": str(lease_id), "beat": beat}, holder_variable(name)
    try:
        if client.read_variable_by_name(var) is None:
            client.create_variable(VariableCreate(name=var, value=value, tags=["symfuse"]))
        else:
            client.update_variable(VariableUpdate(name=var, value=value))
    except Exception as exc:
        log.warning(
            "run lock %s: holder not recorded (%s); a restart of this run waits for the lease", name, _short(exc)
        )


def _release_dead(client: Any, name: str, holder: Mapping[str, Any], log: Any) -> None:
    """Free the lease of an earlier, dead attempt of this flow run (already gone on the server is fine)."""
    log.info(
        "run lock %s is held by attempt %s of this same flow run, which is gone (this is attempt %s); taking it over",
        name, holder["attempt"], (_ATTEMPT.get() or {}).get("attempt"),
    )  # fmt: skip
    with contextlib.suppress(Exception):
        client.release_concurrency_slots_with_lease(UUID(str(holder["lease"])))


def _free_expired(client: Any, name: str, holder: Mapping[str, Any], still: float, log: Any) -> None:
    """Free the slot of a holder whose beat stopped longer ago than its lease lasts (killed: SIGKILL, a lost machine).

    A server started for one command keeps leases in memory: the next one reads the slot as taken from its database,
    with no lease left to run out, and a run of that id waited forever.
    """
    from prefect.client.schemas.actions import GlobalConcurrencyLimitUpdate

    log.warning("run lock %s is held by %s, whose last beat was %.0f s ago (longer than its %.0f s lease: it was "
                "killed); taking it over", name, _describe(holder), still, LEASE_SECONDS)  # fmt: skip
    with contextlib.suppress(Exception):
        client.release_concurrency_slots_with_lease(UUID(str(holder["lease"])))
    with contextlib.suppress(Exception):  # the lease may be unknown to this server: the slot count itself
        client.update_global_concurrency_limit(name, GlobalConcurrencyLimitUpdate(active_slots=0))


def _acquire(client: Any, name: str, wait: float | None, log: Any, me: Mapping[str, Any] | None = None) -> Any:
    """A lease on the one slot of ``name``, waiting up to ``wait`` seconds (None: no limit); None when busy.

    A slot held by an earlier attempt of the same flow run (:func:`takes_over`) whose record stood still for
    :data:`QUIET_SECONDS` (by the server's clock, or watched from here) is freed and taken.
    """
    import httpx

    deadline = None if wait is None else time.monotonic() + wait
    said, freed, expired, seen, since = False, set(), set(), None, time.monotonic()
    while True:
        try:
            response = client.increment_concurrency_slots_with_lease(
                names=[name], slots=1, mode="concurrency", lease_duration=LEASE_SECONDS, holder=_holder()
            )
            lease_id = UUID(response.json()["lease_id"])
            _record_holder(client, name, lease_id, me, log)
            return lease_id
        except httpx.HTTPStatusError as exc:
            if exc.response.status_code != 423:  # 423 Locked: held by another run
                raise
            retry = float(exc.response.headers.get("Retry-After", 1.0))
        holder, age = _read_holder_and_age(client, name)
        mark = ((holder or {}).get("lease"), (holder or {}).get("beat"))
        if mark != seen:
            seen, since = mark, time.monotonic()  # the holder renewed (or changed) since the last look
        still = max(age, time.monotonic() - since)
        if still >= QUIET_SECONDS and takes_over(holder, me) and str(holder.get("lease")) not in freed:
            freed.add(str(holder.get("lease")))  # once per lease: a stale record must not loop without a pause
            _release_dead(client, name, holder, log)
            continue
        if holder and still >= LEASE_SECONDS + QUIET_SECONDS and str(holder.get("lease")) not in expired:
            expired.add(str(holder.get("lease")))  # any holder: its lease ran out long ago, wherever it was kept
            _free_expired(client, name, holder, still, log)
            continue
        if not said:
            log.info("run lock %s is held by %s; waiting for it", name, _describe(holder))
            said = True
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            retry = min(retry, left)
        time.sleep(min(max(retry, 0.1), ACQUIRE_POLL_SECONDS))


def _describe(holder: Mapping[str, Any] | None) -> str:
    """``flow run <id>, attempt <n>`` of a holder record, or that it is unrecorded."""
    if not holder:
        return "another flow run (holder not recorded)"
    return f"flow run {holder.get('flow_run')}, attempt {holder.get('attempt')}"


class _LeaseKeeper:
    """Renews a run-lock lease from a daemon thread; takes the slot again if the server lost the lease."""

    def __init__(self, name: str, lease_id: Any, log: Any, me: Mapping[str, Any] | None = None) -> None:
        self.name, self.lease_id, self.log, self.me = name, lease_id, log, me
        self.beat = 0
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
                self._beat(client)
                return
            except httpx.HTTPStatusError as exc:
                if exc.response.status_code not in (404, 410):
                    raise
            self.log.warning("run lock %s: the server lost this run's lease; taking the slot again", self.name)
            self.lease_id = None
        self.lease_id = _acquire(client, self.name, 0, self.log, self.me)
        if self.lease_id is None:
            self.log.warning("run lock %s: another flow run holds the slot now; this run goes on", self.name)

    def _beat(self, client: Any) -> None:
        """Count the holder record's beat up (only while it still names this lease: a takeover's record stays)."""
        holder = _read_holder(client, self.name)
        if self.me is not None and holder is not None and str(holder.get("lease")) == str(self.lease_id):
            self.beat += 1
            _record_holder(client, self.name, self.lease_id, self.me, self.log, self.beat)

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
                _forget_holder(client, self.name, self.lease_id)
        except Exception as exc:  # the lease expires on its own
            self.log.warning("run lock %s: release failed (%s); freed when its lease expires", self.name, _short(exc))


def end_orphaned_task_runs() -> int:
    """On a later attempt of the current flow run, end what the dead earlier attempts left unfinished as Crashed.

    A flow run whose process or machine was lost leaves its task runs Running (or Pending, or awaiting a retry) for
    good; the rescheduled attempt starts new task runs. Call it before the attempt submits any task. Returns how many
    task runs it ended (0 on a first attempt or outside a flow run).
    """
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterId,
        TaskRunFilter,
        TaskRunFilterState,
        TaskRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.context import FlowRunContext
    from prefect.states import Crashed

    ctx = FlowRunContext.get()
    if ctx is None or ctx.flow_run is None:
        return 0
    with get_client(sync_client=True) as client:
        me = _attempt(client)
        if me is None or me["attempt"] <= 1:
            return 0
        unfinished = TaskRunFilterStateType(any_=[StateType.RUNNING, StateType.PENDING, StateType.SCHEDULED])
        orphans = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[ctx.flow_run.id])),
            task_run_filter=TaskRunFilter(state=TaskRunFilterState(type=unfinished)),
        )
        message = f"its flow run's attempt was lost; attempt {me['attempt']} took over (finished work is reused)"
        for run in orphans:
            client.set_task_run_state(run.id, Crashed(message=message), force=True)
    if orphans:
        _logger().info("attempt %d: %d task run(s) a lost attempt left unfinished set Crashed: %s", me["attempt"],
                       len(orphans), ", ".join(sorted(r.name for r in orphans)))  # fmt: skip
    return len(orphans)


def _forget_holder(client: Any, name: str, lease_id: Any) -> None:
    """Delete the holder record of ``name`` if it still names ``lease_id`` (a later holder's record stays)."""
    holder = _read_holder(client, name)
    if holder is not None and str(holder.get("lease")) == str(lease_id):
        with contextlib.suppress(Exception):
            client.delete_variable_by_name(holder_variable(name))


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
