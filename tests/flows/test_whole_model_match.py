"""fusion_pipeline with ``residual-orthogonal``: one task per model aligns the whole stream, exactly; statistics are
recollected on the matched models; a family or anchor it cannot take is refused before anything trains."""

from __future__ import annotations

import shutil

import pytest
import torch

from flows.pipeline import fusion_pipeline
from symfuse.checkpoint import default_base_model
from symfuse.evaluate import load_task_model
from symfuse.preflight import check_run
from symfuse.store import ArtifactStore, layout
from tests.flows.conftest import TOKENIZER_FILES, task_runs, tiny_config
from tests.tiny import save_tiny

KINDS = ["residual-orthogonal", "ffn-permutation", "head-permutation"]


@pytest.fixture(scope="module")
def llama_base(tmp_path_factory):
    """A tiny random llama (RMSNorm: any orthogonal stream map is exact) reading MiniLM's tokenizer."""
    folder = save_tiny(tmp_path_factory.mktemp("llama-base") / "llama", "llama", seed=0, vocab_size=30522,
                       pad_token_id=0)  # fmt: skip
    for name in TOKENIZER_FILES:
        shutil.copy2(default_base_model() / name, folder / name)
    return folder


def _logits(folder, ids):
    model, _ = load_task_model(folder)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits


def test_whole_model_alignment_in_the_pipeline(llama_base, memory_root):
    config = tiny_config(llama_base, memory_root, symmetries=KINDS, strategies=["simple", "regmean"],
                         stats={"kinds": ["gram"], "max_examples": 16, "batch_size": 8},
                         evaluation={"out_of_domain": [], "max_examples": 8})  # fmt: skip
    state = fusion_pipeline(config, return_state=True)
    assert state.is_completed(), state.message
    others = [n for n in config.dataset_names if n != "isear"]
    runs = task_runs(state.state_details.flow_run_id, expect=[f"match-{n}" for n in others])
    assert not any(n.startswith(("assemble-", "modules-")) for n in runs)
    store = ArtifactStore(config.resolved_store_root())
    ids = torch.randint(5, 30522, (2, 12), generator=torch.Generator().manual_seed(0))
    for name in others:
        matched = store.local_cache(layout.matched_key("t", name))
        original = store.local_cache(layout.model_key("t", name))
        torch.testing.assert_close(_logits(matched, ids), _logits(original, ids), rtol=0, atol=1e-4)
        meta = store.manifest(layout.matched_key("t", name))["meta"]
        assert meta["distance_after"] < meta["distance_before"]
        gram = store.manifest(layout.stats_key("t", f"{name}.matched", name, "gram"))["meta"]
        assert gram["how"] == "recollected"  # never the source's Grams under the stream map
    report = (store.local_cache(state.result()["report"]) / "report.md").read_text()
    assert "| whole |" in report


def test_a_family_or_an_anchor_it_cannot_take_is_refused_before_training(tiny_base, llama_base, memory_root):
    bert = tiny_config(tiny_base, memory_root, symmetries=KINDS)
    (line,) = [p for p in check_run(bert) if p.startswith("symmetries")]
    assert "residual-orthogonal" in line and "bert" in line and "drop residual-orthogonal" in line
    bary = tiny_config(llama_base, memory_root, symmetries=KINDS, anchor="barycenter")
    (line,) = [p for p in check_run(bary) if p.startswith("symmetries")]
    assert "barycenter" in line and "anchor" in line
