"""A stored artifact is reused only with the same content key; one made from other inputs is said to be recomputed."""

import logging
import uuid

from symfuse.store import ArtifactStore
from tasks.common import reuse


def test_an_artifact_of_other_inputs_is_named_when_it_is_recomputed(caplog):
    store = ArtifactStore("memory://reuse-test")
    key = "runs/r/eval/simple-plain/meld"
    assert reuse(store, key, "k1", "evaluation") is None  # nothing stored: nothing to say
    store.put_json(key, {"accuracy": 0.5}, "evaluate", content_key="k1")
    with caplog.at_level(logging.INFO, logger="tasks"):
        assert reuse(store, key, "k1", "evaluation") == store.uri(key)
        assert reuse(store, key, "k2", "evaluation") is None  # e.g. the run id's earlier run had another base
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith(f"reused stored evaluation at {store.uri(key)}")
    assert lines[1] == (
        f"stored evaluation at {store.uri(key)} was made from other inputs or settings: recomputing it (the new "
        "version replaces it)"
    )


def test_a_reused_artifact_reads_cached_and_a_flow_calling_the_task_gets_its_uri():
    """Called directly in a flow, submitted or as ``.fn``: the URI; the task run ends Cached only when reused."""
    from prefect import flow

    from tasks.common import symfuse_task

    store = ArtifactStore(f"memory://reuse-flow-{uuid.uuid4().hex}")  # memory:// lives as long as the process
    key = "runs/r/eval/simple-plain/isear"

    @symfuse_task("probe", "probe-{ck}")
    def probe(ck: str) -> str:
        if (uri := reuse(store, key, ck, "evaluation")) is not None:
            return uri
        store.put_json(key, {"accuracy": 0.5}, "evaluate", content_key=ck)
        return store.uri(key)

    @flow
    def composed() -> tuple:
        first = probe("k1", return_state=True)  # computes
        direct, future, state = probe("k1"), probe.submit("k1"), probe("k1", return_state=True)
        return first.name, first.result(), direct, future.result(), future.state.name, state.name, state.result()

    uri = store.uri(key)
    assert composed() == ("Completed", uri, uri, uri, "Cached", "Cached", uri)
    assert probe.fn("k1") == uri
