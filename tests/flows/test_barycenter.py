"""fusion_pipeline with ``anchor: barycenter``: one task per module aligns EVERY model to the mean, exactly."""

from __future__ import annotations

import torch

from flows.pipeline import fusion_pipeline
from symfuse.evaluate import load_task_model
from symfuse.store import ArtifactStore, layout
from tests.flows.conftest import Calls, task_runs, tiny_config


def _logits(folder, ids):
    model, _ = load_task_model(folder)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits


def test_barycenter_pipeline_matches_every_model_and_preserves_function(tiny_base, memory_root, monkeypatch):
    calls = Calls(monkeypatch)
    config = tiny_config(tiny_base, memory_root, anchor="barycenter", strategies=["regmean"],
                         evaluation={"out_of_domain": [], "max_examples": 8})  # fmt: skip
    state = fusion_pipeline(config, return_state=True)
    assert state.is_completed(), state.message
    result = state.result()
    assert result["anchor"] == "barycenter"
    n_modules = 4  # 2 layers x (attn, ffn)
    runs = task_runs(state.state_details.flow_run_id, expect=[f"assemble-{n}" for n in config.dataset_names])
    assert sorted(n for n in runs if n.startswith("match-")) == sorted(
        f"match-barycenter-L{i:02d}.{k}" for i in range(2) for k in ("attn", "ffn")
    )
    assert calls.counts["match_module_many"] == n_modules and calls.counts["match_module"] == 0
    store = ArtifactStore(config.resolved_store_root())
    ids = torch.randint(5, 30522, (2, 12), generator=torch.Generator().manual_seed(0))
    moved = 0.0
    for name in config.dataset_names:  # no model is the anchor: every one is matched, none changes its function
        matched = store.local_cache(layout.matched_key("t", name))
        original = store.local_cache(layout.model_key("t", name))
        torch.testing.assert_close(_logits(matched, ids), _logits(original, ids), rtol=0, atol=1e-4)
        a = load_task_model(matched)[0].state_dict()
        b = load_task_model(original)[0].state_dict()
        moved = max(moved, *(float((a[k] - b[k]).abs().max()) for k in a if a[k].is_floating_point()))
    assert moved > 1e-6  # the transforms are not all the identity
    assert set(result["merged"]) == {"regmean-plain", "regmean-matched"}
    report = (store.local_cache(result["report"]) / "report.md").read_text()
    assert "match_module" in report  # the barycenter tasks' {model: URI} results reach the timings table
    again = Calls(monkeypatch)
    assert fusion_pipeline(config, return_state=True).is_completed()
    assert again.total() == 0, again.counts
