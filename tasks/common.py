"""What every task shares: the store, a scratch folder, timing, the retry settings and the task decorator.

Each task follows one pattern: build its key (``symfuse.store.layout``) and content key (config + input manifests),
return the URI at once when the store already holds that content, else download its inputs, call ONE library
function, upload the result with a manifest (data first, manifest last) and return the URI. Only URIs and small
configs cross task boundaries, never tensors or modules.
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
from symfuse.store import ArtifactStore, content_key, layout
from tasks.policy import RETRIES, RETRY_DELAYS, maybe_inject_fault, retry_transient

__all__ = [
    "ArtifactStore",
    "content_key",
    "layout",
    "logger",
    "maybe_inject_fault",
    "open_store",
    "scratch",
    "symfuse_task",
    "timed",
]


def symfuse_task(name: str, task_run_name: str, gpu: bool = False) -> Callable:
    """The ``@task`` of every pipeline task: transient-only retries, no Prefect result cache (content keys instead).

    Args:
        name: Task name (what ``SYMFUSE_FAIL_ONCE`` matches, besides the run name).
        task_run_name: Template over the task's parameters, e.g. ``"finetune-{dataset}"``.
        gpu: Tag the task ``gpu`` (work that runs on the accelerator; the tag's concurrency limit caps fan-out).
    """
    return task(
        name=name,
        task_run_name=task_run_name,
        tags=["gpu"] if gpu else [],
        retries=RETRIES,
        retry_delay_seconds=RETRY_DELAYS,
        retry_condition_fn=retry_transient,
        cache_policy=NO_CACHE,
        persist_result=False,
    )


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
    """The run's artifact store."""
    return ArtifactStore(config.resolved_store_root())


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


def stage_meta(stage: str, name: str, seconds: float, **extra: Any) -> dict[str, Any]:
    """Manifest ``meta`` every task writes: its stage, task-run name and seconds of work (the report's timings)."""
    return {"stage": stage, "name": name, "seconds": seconds, **extra}


def manifests(store: ArtifactStore, uris: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """Name -> manifest of each input artifact (for :func:`content_key`)."""
    return {name: store.manifest(uri) for name, uri in uris.items()}
