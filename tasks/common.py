"""What every task shares: the store, a scratch folder, timing, the retry settings and the task decorator.

Each task follows one pattern: build its key (``symfuse.store.layout``) and content key (config + input manifests),
return the URI at once when the store already holds that content (:func:`reuse`, which logs it), else download its
inputs, call ONE library function, upload the result with a manifest (data first, manifest last) and return the URI.
Only URIs and small configs cross task boundaries, never tensors or modules. Long library calls get a
:class:`Progress` callback, shown as a progress artifact in the Prefect UI.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from symfuse.config import RunConfig
from symfuse.logs import quiet_third_party  # third-party bars off inside tasks (the user's env wins)
from symfuse.store import ArtifactStore, content_key, layout
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
    decorate = task(
        name=name,
        task_run_name=task_run_name,
        tags=["gpu"] if gpu else [],
        retries=RETRIES,
        retry_delay_seconds=RETRY_DELAYS,
        retry_condition_fn=retry_transient,
        cache_policy=NO_CACHE,
        persist_result=False,
    )
    return lambda fn: decorate(on_device_slot(fn) if gpu else fn)


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


def reuse(store: ArtifactStore, key: str, ck: str, what: str) -> str | None:
    """The URI of ``key`` when the store holds it with content key ``ck`` (logged as reused), else None.

    Args:
        store: The run's store.
        key: The artifact's key.
        ck: The content key the task would write.
        what: What the artifact is, for the log line (e.g. ``"fine-tuned model isear"``).
    """
    if not store.exists(key, ck):
        return None
    uri = store.uri(key)
    logger().info("reused stored %s at %s (key %s): same inputs and settings, nothing recomputed", what, uri, ck[:16])
    return uri


class Progress:
    """A progress callback for library functions: a Prefect progress artifact updated at most every few seconds.

    ``with Progress("finetune-isear") as p: library_call(..., on_progress=p)``. Outside a Prefect run (``.fn()``
    calls) it only remembers the last fraction. The artifact ends at 100 % when the block exits without error.
    """

    def __init__(self, name: str, min_interval: float = 3.0) -> None:
        self.name = name
        self.min_interval = min_interval
        self.fraction = 0.0
        self.artifact_id = None
        self._last = 0.0
        self._lock = threading.Lock()

    def __enter__(self) -> Progress:
        from prefect.context import TaskRunContext

        if TaskRunContext.get() is not None:
            from prefect.artifacts import create_progress_artifact

            with contextlib.suppress(Exception):  # the UI's progress is a courtesy: never fail the task for it
                self.artifact_id = create_progress_artifact(0.0, description=f"{self.name}: progress")
        self._last = time.monotonic()
        return self

    def __call__(self, fraction: float) -> None:
        """Record ``fraction`` (0..1) done; push it to the artifact if ``min_interval`` seconds passed."""
        with self._lock:  # pushes under the lock: a callback from another thread cannot land after the final 100 %
            self.fraction = max(self.fraction, min(1.0, float(fraction)))
            now = time.monotonic()
            if self.artifact_id is None or now - self._last < self.min_interval:
                return
            self._last = now
            self._push()

    def _push(self, attempts: int = 1) -> None:
        from prefect.artifacts import update_progress_artifact

        for _ in range(attempts):
            try:
                update_progress_artifact(self.artifact_id, round(100 * self.fraction, 1))
                return
            except Exception:  # the UI's progress is a courtesy: never fail the task for it
                logger().debug("progress of %s not updated", self.name, exc_info=True)

    def __exit__(self, exc_type, *exc: object) -> None:
        with self._lock:
            if exc_type is None:
                self.fraction = 1.0
            if self.artifact_id is not None:
                self._push(attempts=3)  # the final value: a transient API error must not leave it short of 100 %


@contextlib.contextmanager
def scratch(prefix: str) -> Iterator[Path]:
    """A temporary local folder, removed afterwards (outputs are uploaded from it)."""
    folder = Path(tempfile.mkdtemp(prefix=f"symfuse-{prefix}-"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


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
