"""New checkpoints in the store trigger a re-merge.

``watch_checkpoints`` (scheduled) lists ``runs/<run>/incoming`` and emits ``symfuse.checkpoint.arrived`` for the
checkpoints the run's published merged set was not made from yet (``runs/<run>/published``); ``remerge`` (the
deployment trigger on that event, see ``deployments/prefect.yaml``) runs the pipeline for the current set of models —
the configured datasets plus every incoming checkpoint — and reuses every artifact already in the store through
content keys. A re-merge publishes all or nothing: its merged models and report are staged and become current
together only when every task succeeded; a failed one leaves the previous set, report and record as they were, and
its checkpoints pending (the next tick emits them again once their input is fixed).

Drop a checkpoint in with ``symfuse drop FOLDER --run RUN [--dataset D]`` (validates it, then
``ArtifactStore.put_dir(layout.incoming_key(run, name), folder, producer, meta={"dataset": D})``); without
``meta.dataset`` the name is taken as the dataset. Only artifacts (a folder with the store's ``manifest.json``) count:
a folder copied into ``incoming/`` by hand gets one warning line per tick naming it and the fix, never a re-merge.
"""

from __future__ import annotations

import uuid
from typing import Any

from prefect import flow
from prefect.events import emit_event
from prefect.logging import get_run_logger

from flows.runtime import forward_library_logs, run_lock
from symfuse.config import DatasetConfig, RunConfig
from symfuse.store import ArtifactStore, layout
from symfuse.store.layout import manifest_digest

EVENT = "symfuse.checkpoint.arrived"


def merged_digests(store: ArtifactStore, run: str) -> set[str]:
    """Content digests of the models the published merged set of ``run`` was made from.

    Read from ``runs/<run>/published``, which the pipeline writes last, after every merge and the report succeeded
    and were published together: a failed (re-)merge leaves its checkpoints out, so they stay pending. A store
    written before that record existed: the digests in its merged manifests.
    """
    record = layout.published_key(run)
    if store.exists(record):
        return set(store.get_json(record)["models"].values())
    return {
        d
        for key in store.list(layout.merged_prefix(run))
        for d in store.manifest(key).get("meta", {}).get("model_digests", [])
    }


def event_id(store: ArtifactStore, run: str, checkpoints: list[str]) -> uuid.UUID:
    """The event's id: a function of the run and the checkpoints' content (not of the time).

    Every watch tick that sees the same pending set emits the SAME event, which Prefect's trigger service evaluates
    once (it skips event ids it has seen): one remerge per set of new checkpoints, not one per tick. Prefect forgets
    a seen id after 30 minutes (``prefect.server.events.ordering.SEEN_EXPIRATION``): a set whose re-merge failed
    (still pending, see :func:`merged_digests`) is re-merged by the first tick after that, e.g. once its dataset
    is fixed.
    """
    digests = sorted(manifest_digest(store.manifest(uri)) for uri in checkpoints)
    return uuid.uuid5(uuid.NAMESPACE_URL, f"{EVENT}/{run}/{','.join(digests)}")


def pending_checkpoints(store: ArtifactStore, run: str, prefix: str | None = None) -> list[str]:
    """URIs of the checkpoints under ``prefix`` (default ``runs/<run>/incoming``) that no merge has used yet."""
    done = merged_digests(store, run)
    keys = store.list(prefix or layout.incoming_prefix(run))
    return [store.uri(k) for k in keys if manifest_digest(store.manifest(k)) not in done]


def warn_unmarked(store: ArtifactStore, run: str, prefix: str | None, warn: Any) -> list[str]:
    """Call ``warn`` once per folder under ``prefix`` that is no artifact (a plain copy); returns their URIs."""
    folders = [store.uri(k) for k in store.unmarked(prefix or layout.incoming_prefix(run))]
    for uri in folders:
        warn(
            "%s has no manifest.json (copied in by hand?): the watcher ignores it; store it with "
            "`symfuse drop <checkpoint folder> --run %s --dataset <dataset>` and remove the copy",
            uri,
            run,
        )
    return folders


@flow(name="watch-checkpoints", log_prints=True)
def watch_checkpoints(config: RunConfig, prefix: str | None = None) -> list[str]:
    """Emit ``symfuse.checkpoint.arrived`` (resource ``symfuse.run.<run_id>``) if unmerged checkpoints arrived.

    Args:
        config: The run whose store and run id are watched (sent on to ``remerge`` in the event payload).
        prefix: Store prefix to list (default ``runs/<run_id>/incoming``).

    Returns:
        The new checkpoints' URIs (empty: no event).
    """
    forward_library_logs()
    store = ArtifactStore(config.resolved_store_root())
    log = get_run_logger()
    warn_unmarked(store, config.run_id, prefix, log.warning)
    pending = pending_checkpoints(store, config.run_id, prefix)
    taken = {d.checkpoint for d in with_checkpoints(config, store, pending, log.warning).datasets}
    new = [uri for uri in pending if uri in taken]  # one left out stays pending: emitted, a re-merge every 30 min
    if not new:
        log.info("no new checkpoints under %s", store.uri(prefix or layout.incoming_prefix(config.run_id)))
        return []
    emit_event(
        event=EVENT,
        resource={"prefect.resource.id": f"symfuse.run.{config.run_id}", "prefect.resource.name": config.run_id},
        payload={"config": config.model_dump(mode="json"), "checkpoints": new},
        id=event_id(store, config.run_id, new),
    )
    log.info("emitted %s for %d checkpoint(s): %s", EVENT, len(new), new)
    return new


def with_checkpoints(config: RunConfig, store: ArtifactStore, checkpoints: list[str], warn: Any = None) -> RunConfig:
    """``config`` whose datasets also bring each checkpoint.

    A checkpoint named as a configured dataset replaces that dataset's fine-tuned model; any other joins as a new
    model of its name, evaluated on the dataset it was dropped for (its manifest's ``meta.dataset``, else its name)
    as the run evaluates that dataset (a configured one's source and settings). One named as a configured dataset but
    dropped for another is left out, and ``warn`` (a logger method) says so (``symfuse drop`` refuses it).
    """
    datasets = [d.model_copy() for d in config.datasets]
    by_name = {d.name: d for d in datasets}
    configured = dict(by_name)
    for uri in sorted(checkpoints):
        name = store.key(uri).rsplit("/", 1)[-1]
        dataset = store.manifest(uri).get("meta", {}).get("dataset") or name
        if name in configured and dataset != name:
            if warn is not None:
                warn("%s: named as the run's model %s but dropped for dataset %s — left out; drop it under another "
                     "--name", uri, name, dataset)  # fmt: skip
        elif name in configured:
            by_name[name].checkpoint = uri
        else:
            like = configured.get(dataset)
            new = like.model_copy(update={"name": name, "source": like.data, "checkpoint": uri}) if like else None
            by_name[name] = new or DatasetConfig(name=name, source=dataset, checkpoint=uri)
            datasets.append(by_name[name])
    return config.model_copy(update={"datasets": datasets})


@flow(name="remerge", log_prints=True)
def remerge(config: RunConfig, checkpoints: list[str]) -> dict[str, Any]:
    """Stats → match → merge → evaluate → report for the configured models plus every incoming checkpoint.

    Args:
        config: The run (from the event payload).
        checkpoints: URIs of the checkpoints that triggered this run; every other checkpoint already under
            ``runs/<run_id>/incoming`` joins too.

    Returns:
        The pipeline's result (report URI, merged models, evaluations).
    """
    from flows.pipeline import fusion_pipeline

    forward_library_logs()
    with run_lock(config.run_id):  # held through the pipeline subflow (re-entrant there)
        store = ArtifactStore(config.resolved_store_root())
        current = sorted({*checkpoints, *(store.uri(k) for k in store.list(layout.incoming_prefix(config.run_id)))})
        get_run_logger().info("re-merging with %d incoming checkpoint(s): %s", len(current), current)
        return fusion_pipeline(with_checkpoints(config, store, current, get_run_logger().warning))
