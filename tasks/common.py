"""What every task shares: the store, a scratch folder, timing, the retry settings and the task decorator.

Each task follows one pattern: build its key (``symfuse.store.layout``) and content key (config + input manifests),
return the URI at once when the store already holds that content (:func:`reuse`, which logs it), else download its
inputs, call ONE library function, upload the result with a manifest (data first, manifest last) and return the URI.
Only URIs and small configs cross task boundaries, never tensors or modules. Long library calls get a
:class:`Progress` callback, shown as a progress artifact in the Prefect UI.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from symfuse.config import RunConfig
from symfuse.logs import quiet_third_party  # third-party bars off inside tasks (the user's env wins)
from symfuse.scratch import scratch_dir
from symfuse.store import ArtifactNotFound, ArtifactStore, content_key, layout
from tasks.devices import on_device_slot, task_device
from tasks.policy import RETRIES, RETRY_DELAYS, maybe_inject_fault, retry_transient

__all__ = [
    "ArtifactStore",
    "Progress",
    "content_key",
    "layout",
    "logger",
    "maybe_inject_fault",
    "open_store",
    "quiet_third_party",
    "reuse",
    "scratch",
    "stored_content_key",
    "symfuse_task",
    "task_device",
    "timed",
]


def symfuse_task(name: str, task_run_name: str, gpu: bool = False) -> Callable:
    """The ``@task`` of every pipeline task: transient-only retries, no Prefect result cache (content keys instead).

    Args:
        name: Task name (what ``SYMFUSE_FAIL_ONCE`` matches, besides the run name).
        task_run_name: Template over the task's parameters, e.g. ``"finetune-{dataset}"``.
        gpu: Work on the accelerator: tagged ``gpu``, and run holding one device slot of its worker
            (``tasks/devices.py``; only where the worker sets ``SYMFUSE_DEVICE_SLOTS``), on that slot's device.
    """
    settings = task(
        name=name,
        task_run_name=task_run_name,
        tags=["gpu"] if gpu else [],
        retries=RETRIES,
        retry_delay_seconds=RETRY_DELAYS,
        retry_condition_fn=retry_transient,
        cache_policy=NO_CACHE,
        persist_result=False,
    )
    return lambda fn: settings(shown_cached(on_device_slot(fn) if gpu else fn))


_REUSED: contextvars.ContextVar[str | None] = contextvars.ContextVar("symfuse_reused", default=None)


def shown_cached(fn: Callable) -> Callable:
    """``fn``, ending its task run in Prefect's ``Cached`` state when it returned an artifact :func:`reuse` found.

    Reuse is decided by the store's content keys (not Prefect's result cache); this only names it in the UI, the way
    Prefect's own cache hit does: the task run's transaction reads committed, so the engine names the run ``Cached``.
    The caller gets the URI either way (a flow calling the task directly, a future's ``result()``, ``.fn()``);
    returning a ``Cached`` state instead handed a direct caller the state object.
    """

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        token = _REUSED.set(None)
        try:
            out = fn(*args, **kwargs)
            reused = _REUSED.get()
        finally:
            _REUSED.reset(token)
        from prefect.context import TaskRunContext

        if reused is None or out != reused or TaskRunContext.get() is None:
            return out
        from prefect.transactions import TransactionState, get_transaction

        txn = get_transaction()
        if txn is not None:  # Prefect 3.8's engine names a run whose transaction is committed Cached (a cache hit)
            txn.state = TransactionState.COMMITTED
        return out

    return run


def warm_imports(base_model: str) -> None:
    """Resolve transformers' lazy attributes (auto classes, the base model's modeling and tokenizer modules) once.

    ``transformers`` imports its classes lazily on first attribute access, which is not thread-safe: tasks starting
    together in the thread pool can fail with "cannot import name 'AutoTokenizer'". Call this before fanning out.
    """
    import transformers as T

    from symfuse.checkpoint import resolve_checkpoint

    for name in ("AutoConfig", "AutoTokenizer", "AutoModel", "AutoModelForSequenceClassification",
                 "AutoModelForTokenClassification", "PreTrainedTokenizerFast"):  # fmt: skip
        getattr(T, name)
    folder = resolve_checkpoint(base_model)
    cfg = T.AutoConfig.from_pretrained(str(folder))
    for mapping in (
        T.MODEL_MAPPING,
        T.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING,
        T.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING,
    ):
        with contextlib.suppress(KeyError, ValueError):
            mapping[type(cfg)]
    for arch in getattr(cfg, "architectures", None) or []:
        getattr(T, arch, None)
    with contextlib.suppress(Exception):  # a base without tokenizer files fails later, with the library's message
        T.AutoTokenizer.from_pretrained(str(folder))


def logger() -> logging.Logger | logging.LoggerAdapter:
    """The Prefect run logger inside a run, else this module's logger (``.fn()`` calls in tests)."""
    from prefect.exceptions import MissingContextError
    from prefect.logging import get_run_logger

    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("tasks")


def open_store(config: RunConfig) -> ArtifactStore:
    """The run's artifact store (every task opens it first: third-party progress bars are turned off here too)."""
    quiet_third_party()
    return ArtifactStore(config.resolved_store_root())


def stored_content_key(store: ArtifactStore, key: str) -> str | None:
    """The content key ``key`` was stored with (None when the store does not hold ``key``)."""
    try:
        return store.manifest(key).get("content_key")
    except ArtifactNotFound:
        return None


def reuse(store: ArtifactStore, key: str, ck: str, what: str) -> str | None:
    """The URI of ``key`` when the store holds it with content key ``ck`` (logged as reused), else None.

    Args:
        store: The run's store.
        key: The artifact's key.
        ck: The content key the task would write.
        what: What the artifact is, for the log line (e.g. ``"fine-tuned model isear"``).
    """
    stored = stored_content_key(store, key)  # one read tells both: is it there, and made from what
    if stored is None:
        return None
    if stored != ck:  # e.g. the run id's earlier run had another base model: said, not replaced silently
        logger().info("stored %s at %s was made from other inputs or settings: recomputing it (the new version "
                      "replaces it)", what, store.uri(key))  # fmt: skip
        return None
    uri = store.uri(key)
    _REUSED.set(uri)
    logger().info("reused stored %s at %s (key %s): same inputs and settings, nothing recomputed", what, uri, ck[:16])
    return uri


class _StageBar:
    """One progress artifact per stage of a flow run: the mean of its tasks' fractions, each task named in its text."""

    def __init__(self, stage: str) -> None:
        self.stage = stage
        self.members: dict[str, float] = {}
        self.artifact_id = None
        self.lock = threading.Lock()
        self.last = 0.0

    def text(self) -> tuple[float, str]:
        done = sum(self.members.values()) / max(len(self.members), 1)
        parts = ", ".join(f"{n} {100 * f:.0f} %" for n, f in sorted(self.members.items()))
        return round(100 * done, 1), f"{self.stage}: {parts}"

    def push(self, attempts: int = 1) -> None:
        """Send the current value (callers hold ``lock``); never fails the task (the UI's progress is a courtesy)."""
        from prefect.artifacts import create_progress_artifact, update_progress_artifact

        value, text = self.text()
        for _ in range(attempts):
            try:
                if self.artifact_id is None:
                    self.artifact_id = create_progress_artifact(value, description=text)
                else:
                    update_progress_artifact(self.artifact_id, value, description=text)
                return
            except Exception:
                logger().debug("progress of %s not updated", self.stage, exc_info=True)


_BARS: dict[tuple[str, str], _StageBar] = {}
_BARS_LOCK = threading.Lock()
_STOPPED: set[str] = set()  # flow runs being stopped: their tasks in this process end at their next progress step


class RunStopped(RuntimeError):
    """Raised in a task's progress callback once its flow run is being stopped (SIGTERM, Ctrl-C, cancellation)."""


def stop_running_tasks() -> None:
    """Make the running tasks of the current flow run (in this process) end at their next step.

    Prefect waits for a flow's running thread-pool tasks when the flow is stopped; without this a fine-tune runs on
    to its end (for hours, its run already crashed and, in-process, its server gone). Finished tasks keep what they
    stored; a later run reuses it.
    """
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    if ctx is not None and ctx.flow_run is not None:
        _STOPPED.add(str(ctx.flow_run.id))


class Progress:
    """A progress callback for library functions, shown as ONE Prefect progress artifact per stage of a flow run.

    ``with Progress("finetune-isear") as p: library_call(..., on_progress=p)``. Every task of a stage (``stage``,
    default the name's first word: ``finetune``, ``stats``, ``eval``) adds its fraction to the stage's artifact,
    updated at most every ``min_interval`` seconds; a task ends at 100 % when its block exits without error. Outside a
    Prefect run (``.fn()`` calls) it only remembers the last fraction.
    """

    def __init__(self, name: str, min_interval: float = 3.0, stage: str | None = None) -> None:
        self.name = name
        self.stage = stage or name.split("-", maxsplit=1)[0]
        self.min_interval = min_interval
        self.fraction = 0.0
        self.bar: _StageBar | None = None
        self.flow_run: str | None = None

    def __enter__(self) -> Progress:
        from prefect.context import TaskRunContext

        ctx = TaskRunContext.get()
        if ctx is not None:
            self.flow_run = str(ctx.task_run.flow_run_id)
            with _BARS_LOCK:
                self.bar = _BARS.setdefault((self.flow_run, self.stage), _StageBar(self.stage))
            with self.bar.lock:
                self.bar.members[self.name] = 0.0
                self.bar.push()
        return self

    def __call__(self, fraction: float) -> None:
        """Record ``fraction`` (0..1) done; push the stage's value if ``min_interval`` seconds passed.

        Raises:
            RunStopped: the flow run is being stopped (:func:`stop_running_tasks`).
        """
        if self.flow_run in _STOPPED:
            raise RunStopped(f"{self.name}: its run was stopped; ended at {100 * self.fraction:.0f} %")
        self.fraction = max(self.fraction, min(1.0, float(fraction)))
        if self.bar is None:
            return
        with self.bar.lock:  # pushes under the lock: a callback from another thread cannot land after the final value
            self.bar.members[self.name] = self.fraction
            now = time.monotonic()
            if now - self.bar.last >= self.min_interval:
                self.bar.last = now
                self.bar.push()

    def __exit__(self, exc_type, *exc: object) -> None:
        if exc_type is None:
            self.fraction = 1.0
        if self.bar is not None:
            with self.bar.lock:
                self.bar.members[self.name] = self.fraction
                self.bar.push(attempts=3)  # the final value: a transient API error must not leave it short


@contextlib.contextmanager
def scratch(prefix: str) -> Iterator[Path]:
    """A temporary local folder, removed afterwards (outputs are uploaded from it; see :mod:`symfuse.scratch`)."""
    with scratch_dir(prefix) as folder:
        yield folder


class timed:
    """``with timed() as t: ...`` then ``t.seconds``."""

    def __enter__(self) -> timed:
        self.start = time.perf_counter()
        self.seconds = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = round(time.perf_counter() - self.start, 3)


_FETCH_LOCKS: dict[str, threading.Lock] = {}
_FETCH_GUARD = threading.Lock()


def fetch(store: ArtifactStore, uri: str) -> Path:
    """Local folder of an artifact (``store.local_cache``), one download at a time per artifact in this process.

    Tasks of one flow run share a process (thread pool): a model read by many tasks is downloaded once, and two
    threads never read the same remote file at once (fsspec's memory:// files share one read position).
    """
    with _FETCH_GUARD:
        lock = _FETCH_LOCKS.setdefault(store.uri(uri), threading.Lock())
    with lock:
        return store.local_cache(uri)


def fetch_file(store: ArtifactStore, uri: str) -> Path:
    """Local path of a one-file artifact (see :func:`fetch`)."""
    files = store.manifest(uri)["files"]
    if len(files) != 1:
        raise ValueError(f"{store.uri(uri)} holds {len(files)} files, expected one")
    return fetch(store, uri) / files[0]


def training_classes(config: RunConfig) -> list[str]:
    """The union of the training datasets' classes, each once, in dataset order.

    The label space of union heads, and what out-of-domain sets are scored against.
    """
    from symfuse.data import load_task_dataset
    from symfuse.data.labels import union_label_names

    return union_label_names(load_task_dataset(config.dataset(n).data).labels for n in config.dataset_names)


def stage_meta(stage: str, name: str, seconds: float, **extra: Any) -> dict[str, Any]:
    """Manifest ``meta`` every task writes: its stage, task-run name and seconds of work (the report's timings)."""
    return {"stage": stage, "name": name, "seconds": seconds, **extra}


def manifests(store: ArtifactStore, uris: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """Name -> manifest of each input artifact (for :func:`content_key`)."""
    return {name: store.manifest(uri) for name, uri in uris.items()}
