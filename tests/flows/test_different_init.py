"""The pipeline's report shows what alignment bought when its models come from different initialisations."""

from __future__ import annotations

import math
import shutil

import pytest

from flows.pipeline import fusion_pipeline
from symfuse.checkpoint import default_base_model
from symfuse.store import ArtifactStore, layout
from symfuse.train import finetune
from symfuse.train.finetune import FinetuneConfig
from tests.flows.conftest import TOKENIZER_FILES, tiny_config
from tests.tiny import save_tiny


@pytest.fixture(scope="module")
def two_inits(tmp_path_factory):
    """Two tiny BERTs from different random initialisations, each fine-tuned on isear."""
    minilm = default_base_model()
    out = []
    for seed in (0, 1):
        base = save_tiny(tmp_path_factory.mktemp(f"init{seed}") / "bert", "bert", seed=seed, vocab_size=30522,
                         max_position_embeddings=64)  # fmt: skip
        for name in TOKENIZER_FILES:
            shutil.copy2(minilm / name, base / name)
        cfg = FinetuneConfig(epochs=1, lr=1e-3, batch_size=16, max_length=24, max_train_examples=32,
                             max_eval_examples=16, progress=False)  # fmt: skip
        out.append(finetune(base, "isear", tmp_path_factory.mktemp(f"ft{seed}") / "model", cfg, device="cpu"))
    return out


def test_report_carries_the_loss_paths_of_models_from_different_inits(two_inits, memory_root):
    a, b = two_inits
    datasets = [{"name": "isear", "checkpoint": str(a), "max_eval_examples": 16},
                {"name": "isear-b", "source": "isear", "checkpoint": str(b), "max_eval_examples": 16}]  # fmt: skip
    config = tiny_config(a, memory_root, datasets=datasets, strategies=["simple"], anchor="isear",
                         symmetries=["ffn-permutation", "head-permutation"],
                         evaluation={"out_of_domain": [], "max_examples": 16})  # fmt: skip
    state = fusion_pipeline(config, return_state=True)
    assert state.is_completed(), state.message
    store = ArtifactStore(config.resolved_store_root())
    inspection = store.get_json(layout.inspect_key("t"))
    assert inspection["pairs"][0]["verdict"] != "same-basin", inspection["pairs"][0]
    record = store.get_json(layout.paths_key("t", "isear-b"))
    plain, aligned = record["plain"], record["aligned"]
    assert record["split"] == "validation" and record["examples"] > 0
    for path in (plain, aligned):  # both ends are the same two functions: the aligned model computes B's
        assert math.isclose(path["losses"][0], plain["losses"][0], rel_tol=1e-5)
        assert math.isclose(path["losses"][-1], plain["losses"][-1], rel_tol=1e-4)
        assert all(math.isfinite(x) for x in path["losses"])
    report = (store.local_cache(state.result()["report"]) / "report.md").read_text()
    assert "## Where alignment matters" in report and "isear-b" in report.split("## Where alignment matters")[1]


def test_fine_tunes_of_one_base_measure_no_path(first_run):
    config, state, _ = first_run
    store = ArtifactStore(config.resolved_store_root())
    assert {p["verdict"] for p in store.get_json(layout.inspect_key("t"))["pairs"]} == {"same-basin"}
    assert not [k for k in store.list(layout.run_prefix("t")) if "/paths/" in k]
    report = (store.local_cache(state.result()["report"]) / "report.md").read_text()
    assert "Where alignment matters" not in report
