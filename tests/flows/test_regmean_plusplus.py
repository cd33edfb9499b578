"""RegMean++ in the pipeline: no stored statistics, its Grams collected inside the merge, plain and matched."""

from __future__ import annotations

from safetensors.torch import load_file

from flows.pipeline import fusion_pipeline
from symfuse.store import ArtifactStore, layout
from tasks.merge import strategy_params
from tests.flows.conftest import Calls, tiny_config


def test_strategy_params_give_each_model_its_own_dataset(tiny_base, memory_root):
    config = tiny_config(tiny_base, memory_root, strategies=["regmean++"])
    config.datasets[1].source = "/data/meld_copy"
    p = strategy_params(config, "regmean++", ["meld", "isear"])
    assert p["data"] == ["/data/meld_copy", "isear"] and "alpha" not in p  # alpha: the merger's default
    assert p["max_examples"] == 16 and p["batch_size"] == 8 and p["max_length"] == 24
    assert p["device"] == config.resolved_device()  # where it runs (left out of the merge's content key)
    assert config.stats_kinds() == []  # it reads no stored statistics
    # the user's merge_params reach it, and win over the run's values
    config = config.model_copy(update={"merge_params": {"regmean++": {"alpha": 0.5, "max_examples": 4}}})
    p = strategy_params(config, "regmean++", ["meld", "isear"])
    assert p["alpha"] == 0.5 and p["max_examples"] == 4 and p["batch_size"] == 8


def test_pipeline_merges_with_regmean_plusplus_plain_and_matched(tiny_base, memory_root, monkeypatch):
    config = tiny_config(
        tiny_base,
        memory_root,
        strategies=["regmean", "regmean++"],
        stats={"kinds": ["gram"], "max_examples": 16, "batch_size": 8},
    )
    calls = Calls(monkeypatch)
    state = fusion_pipeline(config, return_state=True)
    assert state.is_completed(), state.message
    merged = state.result()["merged"]
    assert set(merged) == {f"{s}-{v}" for s in ("regmean", "regmean++") for v in ("plain", "matched")}
    assert calls.counts["collect_stats"] == 3  # RegMean's Grams only
    store = ArtifactStore(config.resolved_store_root())
    for variant in ("plain", "matched"):
        m = store.manifest(layout.merged_key("t", "regmean++", variant))
        assert m["meta"]["strategy"] == "regmean++" and set(m["meta"]["heads"]) == set(config.dataset_names)
        assert not any(k.startswith("stats") for k in m["inputs"])
    pp = load_file(str(store.local_cache(merged["regmean++-plain"]) / "model.safetensors"))
    rm = load_file(str(store.local_cache(merged["regmean-plain"]) / "model.safetensors"))
    name = "bert.encoder.layer.1.attention.self.query.weight"
    assert float((pp[name] - rm[name]).norm()) > 1e-6 * float(rm[name].norm())  # not RegMean's merge
    evaluated = {store.get_json(u)["model"] for u in state.result()["evaluations"]}
    assert {"regmean++-plain", "regmean++-matched"} <= evaluated
