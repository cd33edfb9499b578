"""``publish_run``: the run's merged set and report become current together, then the record of what they were made of.

The merges and the report of a run are staged (``merge`` / ``report`` write versions that readers of
``runs/<run>/merged/*`` and ``runs/<run>/report`` do not see yet); this task, the pipeline's last, runs only when
every task succeeded. A failed run publishes nothing: readers keep the previous set and report, whole, and
``runs/<run>/published`` keeps listing the previous models (so ``watch_checkpoints`` still sees a new checkpoint as
pending).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from symfuse.config import RunConfig
from tasks.common import layout, logger, open_store, symfuse_task


@symfuse_task("publish", "publish-{config.run_id}")
def publish_run(config: RunConfig, models: Mapping[str, str], merged: Mapping[str, str], report: str) -> dict[str, Any]:
    """Publish the staged merged models and report (all checked whole first), then write ``runs/<run>/published``.

    Args:
        config: The run.
        models: Dataset name -> model URI (what the merged set was made from).
        merged: Merged name (``simple-plain``) -> URI, staged or published already (a reused merge).
        report: The report's URI, staged or published.

    Returns:
        ``{"report": URI, "merged": {name: URI}}``, the published URIs.

    Raises:
        ArtifactNotFound / CorruptArtifact: a staged version is gone or not whole: nothing was published.
    """
    store = open_store(config)
    store.publish([*merged.values(), report])  # every pointer moves only once every staged version is whole
    published = {name: store.uri(uri) for name, uri in merged.items()}
    record = {
        "models": {n: layout.manifest_digest(store.manifest(uri)) for n, uri in models.items()},
        "merged": {n: {"uri": uri, "version": store.manifest(uri).get("version")} for n, uri in published.items()},
        "report": {"uri": store.uri(report), "version": store.manifest(report).get("version")},
    }
    key = layout.published_key(config.run_id)
    if not store.exists(key) or store.get_json(key) != record:  # the same set again: nothing to write
        inputs = {f"model.{n}": store.uri(u) for n, u in models.items()} | {"report": store.uri(report)}
        store.put_json(key, record, "publish", inputs | {f"merged.{n}": u for n, u in published.items()})
    logger().info("published %d merged model(s) and the report of %s", len(published), config.run_id)
    _name_stale_merges(store, config.run_id, published.values())
    return {"report": store.uri(report), "merged": published}


def _name_stale_merges(store: Any, run_id: str, current: Iterable[str]) -> None:
    """Warn about merged models an earlier run of ``run_id`` stored with strategies this one does not run.

    They stay readable under ``merged/`` (made from the models of that earlier run); the ``published`` record names
    the current set. Deleting them is left to the user, who may still want them.
    """
    mine = {store.key(u) for u in current}
    stale = [k for k in store.list(f"{layout.run_prefix(run_id)}/merged") if k not in mine]
    if stale:
        logger().warning("%d merged model(s) under %s/merged are from an earlier run of %s and not part of this one "
                         "(%s): read the published record for the current set, or delete them",
                         len(stale), store.uri(layout.run_prefix(run_id)), run_id, ", ".join(stale))  # fmt: skip
