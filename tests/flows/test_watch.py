"""watch_checkpoints emits symfuse.checkpoint.arrived for unmerged checkpoints; remerge reuses what is computed."""

from __future__ import annotations

import flows.watch
from flows.watch import EVENT, remerge, watch_checkpoints
from symfuse.config import RunConfig
from symfuse.store import ArtifactStore, layout
from tasks.common import fetch
from tasks.finetune import finetune
from tests.flows.conftest import Calls


def test_watch_then_remerge(first_run, monkeypatch):
    config, _, _ = first_run
    store = ArtifactStore(config.resolved_store_root())
    assert watch_checkpoints(config) == []  # nothing dropped in yet

    # a new meld checkpoint arrives (fine-tuned with another seed, in another run of the same store)
    other = config.model_copy(update={"run_id": "other", "finetune": config.finetune.model_copy(update={"seed": 7})})
    incoming = layout.incoming_key(config.run_id, "meld")
    store.put_dir(incoming, fetch(store, finetune.fn(other, "meld")), "test", meta={"dataset": "meld"})

    events = []
    real_emit = flows.watch.emit_event
    monkeypatch.setattr(flows.watch, "emit_event", lambda **kw: events.append(kw) or real_emit(**kw))
    new = watch_checkpoints(config)
    assert new == [store.uri(incoming)]
    (event,) = events
    assert event["event"] == EVENT
    assert event["resource"]["prefect.resource.id"] == f"symfuse.run.{config.run_id}"
    assert event["payload"]["checkpoints"] == new

    calls = Calls(monkeypatch)  # what the deployment trigger would run, with the event's parameters
    result = remerge(RunConfig.model_validate(event["payload"]["config"]), event["payload"]["checkpoints"])
    assert calls.counts["finetune_model"] == 0  # isear, dair_emotion reused; meld brought
    # plain statistics only for the new meld model; none recomputed for the others
    stats_keys = [k for k in store.list(layout.run_prefix(config.run_id) + "/stats") if ".matched" not in k]
    assert len(stats_keys) == 3 * 2
    assert 2 <= calls.counts["collect_stats"] <= 2 + 2  # + Fisher recollected on re-matched models
    # every merged model is new (meld changed); individual isear / dair_emotion evaluations are reused
    assert calls.counts["merge_checkpoints"] == 6
    # 6 merges on the 3 in-domain sets, their per-dataset heads voting on goemotions_ekman; meld on all 4 sets
    assert calls.counts["evaluate_model"] == 6 * 3 + 4 and calls.counts["evaluate_heads"] == 6
    model = store.manifest(layout.model_key(config.run_id, "meld"))
    assert layout.manifest_digest(model) == layout.manifest_digest(store.manifest(incoming))
    assert result["report"] and watch_checkpoints(config) == []  # merged now: no new event


def test_a_checkpoint_left_out_of_the_re_merge_is_named_and_not_emitted(tmp_path, monkeypatch):
    """Named as a run model but dropped for another dataset, it stayed pending: a re-merge every 30 minutes."""
    store = ArtifactStore(str(tmp_path / "store"))
    config = RunConfig(run_id="r1", store_root=str(tmp_path / "store"), datasets=[{"name": "isear"}, {"name": "meld"}])
    folder = tmp_path / "ckpt"
    folder.mkdir()
    uris = []
    for name, dataset in (("isear", "meld"), ("meld", "meld")):
        (folder / "config.json").write_text(f'{{"name": "{name}"}}')  # another content each
        uris.append(store.put_dir(layout.incoming_key("r1", name), folder, "test", meta={"dataset": dataset}))
    events, warnings = [], []
    monkeypatch.setattr(flows.watch, "emit_event", lambda **kw: events.append(kw))
    monkeypatch.setattr(flows.watch, "get_run_logger", lambda: _Logger(warnings))
    assert watch_checkpoints(config) == [uris[1]]
    assert events[0]["payload"]["checkpoints"] == [uris[1]]
    (line,) = warnings
    assert line.startswith(f"{uris[0]}: named as the run's model isear but dropped for dataset meld — left out")


class _Logger:
    def __init__(self, warnings):
        self.warning = lambda msg, *args: warnings.append(msg % args)
        self.info = lambda *_: None
