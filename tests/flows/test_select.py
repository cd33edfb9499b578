"""The pipeline with union labels and greedy selection, on tiny models."""

from __future__ import annotations

from flows.pipeline import fusion_pipeline
from symfuse.data import load_task_dataset
from symfuse.data.labels import EMOTION_SHARED, union_label_names
from symfuse.store import ArtifactStore, layout
from tests.flows.conftest import tiny_config


def test_union_labels_and_greedy_selection_end_to_end(tiny_base, memory_root):
    config = tiny_config(tiny_base, memory_root, strategies=["simple", "fisher", "regmean"], labels="union",
                         select="greedy", symmetries=["ffn-permutation"], anchor="isear")  # fmt: skip
    out = fusion_pipeline(config)
    store = ArtifactStore(config.resolved_store_root())
    names = config.dataset_names
    union = union_label_names(load_task_dataset(n).labels for n in names)

    # every model has the one union head; a merge keeps one folder whose head learned every class
    for n in names:
        model = store.local_cache(store.uri(layout.model_key("t", n)))
        assert (model / "config.json").read_text().count('"learned"') == 1
    merged = store.local_cache(out["merged"]["regmean-plain"])
    assert '"policy": "union"' in (merged / "symfuse_report.json").read_text()
    for n in names:
        rec = store.get_json(layout.eval_key("t", "regmean-plain", n))
        assert rec["metrics"]["in_domain"] and rec["metrics"]["classes"] == load_task_dataset(n).labels
    ood = store.get_json(layout.eval_key("t", "regmean-plain", "goemotions_ekman"))
    assert not ood["metrics"]["in_domain"] and ood["metrics"]["classes"] == list(EMOTION_SHARED)
    assert len(union) == len(set(union))

    # greedy: every model scored on the validation splits, the path tries each of the others once
    for strategy in ("simple", "regmean"):
        sel = store.get_json(layout.selection_key("t", strategy))
        path = sel["path"]
        assert path[0]["subset"] == [path[0]["added"]] and len(path) == len(names)
        own = [store.get_json(layout.eval_key("t", f"val-{path[0]['added']}", n))["metrics"] for n in names]
        assert path[0]["score"] == sum(m[m["primary"]] for m in own) / len(own)  # the best model's own score
        assert sorted(s["added"] for s in path) == sorted(names)
        kept = [s["added"] for s in path if s["kept"]]
        assert sel["chosen"] == kept and sel["score"] == max(s["score"] for s in path if s["kept"])
        assert sel["on"] == names and sel["split"] == "validation"
        assert f"{strategy}-greedy" in out["merged"]
        rec = store.get_json(layout.eval_key("t", f"{strategy}-greedy", "meld"))
        assert rec["variant"] == "greedy" and rec["metrics"]["split"] == "test"
        first = path[0]["added"]
        val = store.get_json(layout.eval_key("t", f"val-{first}", "meld"))
        assert val["metrics"]["split"] == "validation"
    text = (store.local_cache(out["report"]) / "report.md").read_text()
    assert "## Greedy selection of the models to merge" in text and "`regmean-greedy`" in text


def test_a_failed_greedy_merge_fails_the_run_with_its_own_error(tiny_base, memory_root, monkeypatch):
    import pytest

    import tasks.merge
    from symfuse.merge import merge_checkpoints

    def merge(strategy, models, out, **kw):
        if len(models) == 2:  # the first subset greedy tries
            raise ValueError("regmean: this two-model merge is broken (injected)")
        return merge_checkpoints(strategy, models, out, **kw)

    monkeypatch.setattr(tasks.merge, "merge_checkpoints", merge)
    config = tiny_config(tiny_base, memory_root, run_id="greedy-fails", strategies=["simple"], select="greedy",
                         anchor="isear", evaluation={"out_of_domain": [], "max_examples": 8})  # fmt: skip
    state = fusion_pipeline(config, return_state=True)
    assert state.is_failed()
    with pytest.raises(ValueError, match="this two-model merge is broken"):
        state.result()
