"""Flow tests: ONE Prefect test harness for the session, a tiny BERT base with the MiniLM tokenizer, run configs."""

from __future__ import annotations

import collections
import shutil
import threading
import uuid
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

import symfuse.match
import symfuse.stats
import tasks.evaluate
import tasks.finetune
import tasks.merge
import tasks.report
from symfuse.checkpoint import default_base_model
from symfuse.config import RunConfig
from tests.tiny import nan_copy, save_tiny

TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@pytest.fixture(scope="session", autouse=True)
def prefect_harness():
    """A temporary Prefect database and server for every flow test (started once: ~15-30 s here)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory) -> Path:
    """A tiny random BERT (2 layers, d=32) that reads MiniLM's tokenizer (vocab 30522): a stand-in base model."""
    folder = save_tiny(tmp_path_factory.mktemp("tiny-base") / "bert", "bert", seed=0, vocab_size=30522,
                       max_position_embeddings=64)  # fmt: skip
    minilm = default_base_model()
    for name in TOKENIZER_FILES:
        shutil.copy2(minilm / name, folder / name)
    return folder


@pytest.fixture(scope="session")
def nan_base(tiny_base, tmp_path_factory) -> Path:
    """The tiny base with one NaN weight: a bad input only reading the weights finds (the fine-tune does)."""
    return nan_copy(tiny_base, tmp_path_factory.mktemp("nan-base") / "bert")


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    """Downloads of remote artifacts go to a per-test cache; no fault injected unless a test sets it."""
    monkeypatch.setenv("SYMFUSE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("SYMFUSE_FAIL_ONCE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def tiny_config(base: Path, store_root: str, **overrides) -> RunConfig:
    """Three emotion datasets, a handful of examples each, every strategy plain and matched."""
    data = {
        "run_id": "t",
        "base_model": str(base),
        "datasets": [
            {"name": n, "max_train_examples": 32, "max_eval_examples": 24} for n in ("isear", "meld", "dair_emotion")
        ],
        "finetune": {"epochs": 1, "lr": 1e-3, "batch_size": 16, "max_length": 24},
        "stats": {"kinds": ["gram", "fisher"], "max_examples": 16, "batch_size": 8},
        "strategies": ["simple", "fisher", "regmean"],
        "evaluation": {"out_of_domain": ["goemotions_ekman"], "max_examples": 24},
        "anchor": "isear",
        "device": "cpu",
        "store_root": store_root,
    }
    data.update(overrides)
    return RunConfig.model_validate(data)


@pytest.fixture
def memory_root() -> str:
    """A fresh memory:// store root."""
    return f"memory://symfuse-{uuid.uuid4().hex[:10]}"


# Library entry points the tasks call, by (module, attribute): each call is one executed stage.
ENTRY_POINTS = [
    (tasks.finetune, "finetune_model"),
    (symfuse.stats, "collect_stats"),
    (symfuse.stats, "transform_stats"),
    (symfuse.match, "match_module"),
    (symfuse.match, "match_module_many"),
    (symfuse.match, "assemble_matched"),
    (tasks.merge, "merge_checkpoints"),
    (tasks.evaluate, "evaluate_model"),
    (tasks.evaluate, "evaluate_heads"),
    (tasks.report, "build_report"),
]


class Calls:
    """Counts the library calls made by tasks (thread-safe: tasks run in a thread pool)."""

    def __init__(self, monkeypatch):
        self.counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        for module, name in ENTRY_POINTS:
            monkeypatch.setattr(module, name, self._spy(name, getattr(module, name)))

    def _spy(self, name, fn):
        def spy(*args, **kwargs):
            with self._lock:
                self.counts[name] += 1
            return fn(*args, **kwargs)

        return spy

    def total(self) -> int:
        return sum(self.counts.values())


def task_runs(flow_run_id, expect=(), timeout: float = 60) -> dict[str, object]:
    """Task-run name -> task run of one flow run; waits until the ``expect``ed names are recorded in a final state
    (task runs reach the API through events, a moment after the flow returns)."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        with get_client(sync_client=True) as client:
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        found = {r.name: r for r in runs}
        if all(n in found and found[n].state and found[n].state.is_final() for n in expect):
            return found
        if time.monotonic() > deadline:
            return found
        time.sleep(0.5)


@pytest.fixture(scope="session")
def first_run(tiny_base, tmp_path_factory):
    """One full pipeline run on a memory:// store with transient faults injected into four tasks."""
    mp = pytest.MonkeyPatch()
    mp.setenv("SYMFUSE_CACHE", str(tmp_path_factory.mktemp("cache")))
    mp.setenv("SYMFUSE_FAIL_ONCE", "finetune-isear:oom,match-*-L01.ffn,stats-dair_emotion-gram,merge-simple-plain")
    calls = Calls(mp)
    config = tiny_config(tiny_base, f"memory://pipeline-{tmp_path_factory.mktemp('x').name}", anchor="closest")
    from flows.pipeline import fusion_pipeline

    state = fusion_pipeline(config, return_state=True)
    mp.undo()
    return config, state, calls


def run_logs(flow_run_id, expect: str = "", timeout: float = 60) -> list[str]:
    """``logger name: message`` of every log of one flow run (and its task runs) the API holds; waits (logs reach
    the API in batches) until a line contains ``expect``."""
    import time

    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()
    deadline = time.monotonic() + timeout
    while True:
        with get_client(sync_client=True) as client:
            logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
        lines = [f"{log.name}: {log.message}" for log in logs]
        if any(expect in line for line in lines) or time.monotonic() > deadline:
            return lines
        time.sleep(0.5)
