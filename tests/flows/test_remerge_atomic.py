"""A re-merge publishes all or nothing: a failed one leaves the merged set, the report and the pending checkpoint."""

from __future__ import annotations

import shutil

import pytest

import flows.pipeline
from flows.pipeline import fusion_pipeline
from flows.watch import remerge, watch_checkpoints
from symfuse.data.locate import find_named_dataset
from symfuse.store import ArtifactStore, layout
from tasks.common import fetch
from tasks.finetune import finetune
from tests.flows.conftest import Calls, tiny_config

SMALL = {"max_train_examples": 32, "max_eval_examples": 16}


def published(store: ArtifactStore, run: str) -> dict[str, str]:
    """Key -> current version of every merged model, the report and the run's record."""
    keys = [*store.list(layout.merged_prefix(run)), layout.report_key(run), layout.published_key(run)]
    return {key: store.manifest(key)["version"] for key in keys}


def test_failed_remerge_publishes_nothing_then_the_fixed_one_publishes_the_whole_set(
    tiny_base, memory_root, tmp_path, monkeypatch
):
    config = tiny_config(
        tiny_base,
        memory_root,
        run_id="atomic",
        datasets=[{"name": n, **SMALL} for n in ("isear", "dair_emotion")],
        stats={"kinds": ["gram"], "max_examples": 16, "batch_size": 8},
        strategies=["simple", "regmean"],
        evaluation={"out_of_domain": [], "max_examples": 16},
    )
    run = config.run_id
    fusion_pipeline(config)
    store = ArtifactStore(config.resolved_store_root())
    before = published(store, run)
    assert len(before) == 4 + 2 and watch_checkpoints(config) == []

    # a meld checkpoint arrives; its dataset is a folder that is there when the run checks its inputs, then gone
    data = tmp_path / "meld-data"
    shutil.copytree(find_named_dataset("meld"), data)
    other = tiny_config(tiny_base, memory_root, run_id="other", datasets=[{"name": "meld", **SMALL}], anchor="meld")
    incoming = layout.incoming_key(run, "meld")
    store.put_dir(incoming, fetch(store, finetune.fn(other, "meld")), "test", meta={"dataset": str(data)})
    pending = watch_checkpoints(config)
    assert pending == [store.uri(incoming)]

    check = flows.pipeline.require_runnable

    def check_then_lose_the_data(cfg):
        check(cfg)
        shutil.rmtree(data)

    monkeypatch.setattr(flows.pipeline, "require_runnable", check_then_lose_the_data)
    with pytest.raises(Exception, match="meld-data"):
        remerge(config, pending)
    # the simple merges (they read no data) were made, but only staged: every reader still sees the old set
    staged = store.fs.ls(store._path(layout.merged_key(run, "simple", "plain"), ".v"))
    assert len(staged) == 2
    assert published(store, run) == before
    assert watch_checkpoints(config) == pending  # still pending: retried once its dataset is back

    monkeypatch.setattr(flows.pipeline, "require_runnable", check)
    shutil.copytree(find_named_dataset("meld"), data)  # the dataset is fixed
    result = remerge(config, pending)
    after = published(store, run)
    assert set(after) == set(before) and all(after[k] != before[k] for k in before)  # every one replaced
    digest = layout.manifest_digest(store.manifest(incoming))
    assert digest in store.get_json(layout.published_key(run))["models"].values()
    for name, uri in result["merged"].items():
        assert uri == store.uri(store.key(uri))  # published URIs, not staged ones
        assert set(store.manifest(uri)["meta"]["heads"]) == {"isear", "dair_emotion", "meld"}, name
    assert result["report"] == store.uri(layout.report_key(run))
    assert "meld" in (store.local_cache(layout.report_key(run)) / "metrics.csv").read_text()
    assert watch_checkpoints(config) == []  # merged and published: nothing pending

    calls = Calls(monkeypatch)
    again = remerge(config, [])  # the same set again: every artifact reused, nothing staged, nothing moves
    assert calls.total() == 0 and again["merged"] == result["merged"] and published(store, run) == after
