"""A stored artifact is reused only with the same content key; one made from other inputs is said to be recomputed."""

import logging

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
