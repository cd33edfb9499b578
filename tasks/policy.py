"""Retry policy shared by every task: retry transient faults only, shrink the micro-batch after an OOM.

Transient (retried): CUDA out-of-memory, CUDA / driver errors, and storage or connection errors as the store raises
them (``ConnectionError``, ``TimeoutError``, ``OSError`` other than "not found" / "permission denied" / "exists"),
a download cut short (``IncompleteDownload``).
Deterministic (fail at once): everything else — ``ValueError`` (bad input, shapes, NaN; most ``SymfuseError`` are
one), ``TypeError``, ``KeyError``, assertion errors, missing artifacts, a damaged artifact (``CorruptArtifact``:
the store's own bytes differ from the manifest, so every read finds the same).

Fault injection for tests and demos: ``SYMFUSE_FAIL_ONCE=<pattern>[,<pattern>...]`` makes every task whose name or
task-run name matches a pattern (``fnmatch``; e.g. ``finetune``, ``match-isear-L00.attn``, ``match-*``) raise a
transient fault on its first attempt. ``<pattern>:oom`` raises a (simulated) CUDA out-of-memory error instead of a
connection error, which also exercises the micro-batch halving. The attempt is read from the task run context's
``run_count``, so a retry of the same task run succeeds.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import threading

import torch

from symfuse.store.errors import CorruptArtifact, IncompleteDownload

FAIL_ONCE_ENV = "SYMFUSE_FAIL_ONCE"
RETRIES = 3
RETRY_DELAYS = [1, 10, 30]  # seconds before retry 1, 2, 3

log = logging.getLogger(__name__)

# OOM failures seen per task run (id -> count); the retry condition writes it, the next attempt reads it.
_OOM_COUNTS: dict[str, int] = {}
_LOCK = threading.Lock()

_CUDA_MARKERS = ("CUDA error", "CUDA driver", "CUDNN_STATUS", "cuDNN error", "CUBLAS_STATUS", "NCCL error", "ECC error")
_DETERMINISTIC_OS = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)


class InjectedFault(ConnectionError):
    """A transient fault raised on purpose by ``SYMFUSE_FAIL_ONCE`` (looks like a lost store connection)."""


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is a (CUDA) out-of-memory error."""
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()
    )


def is_transient(exc: BaseException) -> bool:
    """Whether retrying can help: OOM, CUDA/driver errors, storage/connection errors (see module docstring).

    ``ValueError`` and its subclasses (all of symfuse's own errors, shape and NaN checks) are never transient,
    even when caused by a transient-looking error.
    """
    if isinstance(exc, ValueError | TypeError | KeyError | AssertionError | ArithmeticError):
        return False
    if is_oom(exc):
        return True
    if isinstance(exc, RuntimeError):
        text = str(exc)
        # A device-side assert is an indexing bug in the inputs: retrying repeats it.
        return "device-side assert" not in text and any(m in text for m in _CUDA_MARKERS)
    if isinstance(exc, ConnectionError | TimeoutError):
        return True
    if isinstance(exc, CorruptArtifact):  # the store's bytes are damaged: the same on every read
        return isinstance(exc, IncompleteDownload)
    return isinstance(exc, OSError) and not isinstance(exc, _DETERMINISTIC_OS)


def retry_transient(task, task_run, state) -> bool:
    """Prefect ``retry_condition_fn``: retry transient faults only; remember OOMs for :func:`batch_settings`.

    Args:
        task: The Prefect task.
        task_run: Its run (``id`` keys the OOM count).
        state: The failed state; its data is the raised exception.

    Returns:
        True to let Prefect retry (within ``retries``), False to fail now.
    """
    exc = state.data
    if not isinstance(exc, BaseException):
        try:
            exc = state.result(raise_on_failure=False)
        except Exception as err:  # the exception could not be read back: do not guess
            log.warning("%s: cannot read the failure (%s); not retrying", task_run.name, err)
            return False
    if not isinstance(exc, BaseException):
        return False
    transient = is_transient(exc)
    if transient and is_oom(exc):
        with _LOCK:
            _OOM_COUNTS[str(task_run.id)] = _OOM_COUNTS.get(str(task_run.id), 0) + 1
    if not transient:
        log.error("%s: deterministic error, not retrying: %s: %s", task_run.name, type(exc).__name__, exc)
    return transient


def _run_context():
    from prefect.context import TaskRunContext

    return TaskRunContext.get()


def oom_count() -> int:
    """How many times the current task run has failed with out-of-memory (0 outside Prefect)."""
    ctx = _run_context()
    if ctx is None:
        return 0
    with _LOCK:
        return _OOM_COUNTS.get(str(ctx.task_run.id), 0)


def batch_settings(batch_size: int, grad_accum: int = 1) -> tuple[int, int]:
    """The micro-batch and gradient accumulation for this attempt: halved / doubled once per OOM seen.

    The effective batch (``batch_size * grad_accum``) never changes, so results are the same.

    Args:
        batch_size: Configured micro-batch.
        grad_accum: Configured gradient accumulation steps.

    Returns:
        ``(micro_batch, grad_accum)`` for this attempt.
    """
    micro, accum = batch_size, grad_accum
    for _ in range(oom_count()):
        if micro <= 1:
            break
        half = micro // 2
        if half * 2 != micro:  # odd micro-batch: halving would change the effective batch
            break
        micro, accum = half, accum * 2
    if (micro, accum) != (batch_size, grad_accum):
        log.warning(
            "after out-of-memory: micro-batch %d -> %d, grad accumulation %d -> %d",
            batch_size,
            micro,
            grad_accum,
            accum,
        )
    return micro, accum


def _patterns() -> list[tuple[str, str]]:
    spec = os.environ.get(FAIL_ONCE_ENV, "")
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        pattern, _, kind = item.partition(":")
        out.append((pattern, kind or "connection"))
    return out


def maybe_inject_fault() -> None:
    """Raise a transient fault if ``SYMFUSE_FAIL_ONCE`` names the current task and this is its first attempt.

    Raises:
        InjectedFault: a simulated lost connection.
        torch.OutOfMemoryError: a simulated CUDA out-of-memory (pattern suffix ``:oom``).
    """
    ctx = _run_context()
    if ctx is None or ctx.task_run.run_count > 1:
        return
    names = (ctx.task.name, ctx.task_run.name)
    for pattern, kind in _patterns():
        if any(fnmatch.fnmatchcase(n, pattern) for n in names):
            msg = f"injected transient fault in {ctx.task_run.name} (attempt 1; {FAIL_ONCE_ENV}={pattern}:{kind})"
            if kind == "oom":
                raise torch.OutOfMemoryError(f"CUDA out of memory. {msg}")
            raise InjectedFault(msg)
