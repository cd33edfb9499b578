"""Greedy selection's tasks: a model's validation score, and the selection record (chosen subset, path)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from symfuse.config import RunConfig
from symfuse.merge.select import validation_score as mean_primary
from tasks.common import content_key, layout, manifests, open_store, reuse, stage_meta, symfuse_task, timed


@symfuse_task("validation_score", "score-{model}")
def validation_score(config: RunConfig, model: str, evaluations: Sequence[str]) -> float:
    """The mean primary metric of ``model``'s validation evaluations (eval record URIs): greedy selection's score."""
    store = open_store(config)
    return mean_primary([store.get_json(uri) for uri in evaluations])


@symfuse_task("record_selection", "selection-{strategy}")
def record_selection(config: RunConfig, strategy: str, selection: Mapping[str, Any], models: Mapping[str, str]) -> str:
    """Store greedy selection's record for ``strategy`` (``runs/{run}/selection/{strategy}``); return its URI.

    Args:
        config: The run.
        strategy: The merge strategy the subsets were merged with.
        selection: :meth:`symfuse.merge.select.Selection.to_json` plus the validation sets (``on``).
        models: The merges tried: ``m1+m2+...`` -> URI (the models themselves for single ones).
    """
    store = open_store(config)
    key = layout.selection_key(config.run_id, strategy)
    record = {"strategy": strategy, **selection, "merges": dict(models)}
    ck = content_key({"selection": record}, manifests(store, dict(models)))
    if (uri := reuse(store, key, ck, f"greedy selection for {strategy}")) is not None:
        return uri
    with timed() as t:
        meta = stage_meta("select", f"selection-{strategy}", t.seconds, strategy=strategy,
                          chosen=list(selection["chosen"]))  # fmt: skip
    return store.put_json(key, record, "select", dict(models), ck, meta)
