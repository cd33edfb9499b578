"""Housekeeping at the start of a run: what killed uploads and killed processes left behind is removed."""

from __future__ import annotations

from symfuse.config import RunConfig
from symfuse.scratch import clean_stale_scratch
from symfuse.store import layout
from tasks.common import logger, open_store, symfuse_task


@symfuse_task(name="clean-store", task_run_name="clean-store-{config.run_id}")
def clean_store(config: RunConfig) -> list[str]:
    """Remove this run's unpublished artifact versions older than the store's grace period.

    A killed upload leaves a version folder that no manifest names (never readable); the next run of the same
    ``run_id`` collects it. Published versions and young ones (a live writer's) are never touched. Scratch folders
    of processes that are gone (a SIGKILLed task) are removed from this machine's temporary folder too. The run's
    ``published`` record, which the run writes over last, is read first, so that a damaged one stops the run now.

    Returns:
        The URIs of the removed version folders.

    Raises:
        CorruptArtifact: the run's ``published`` record is damaged.
    """
    clean_stale_scratch()
    store = open_store(config)
    if store.exists(published := layout.published_key(config.run_id)):  # written over last: a damaged one fails now,
        store.get_json(published)  # not after every fine-tune and merge ran (CorruptArtifact names it, with the fix)
    removed = store.gc(layout.run_prefix(config.run_id))
    if removed:
        logger().info("removed %d unpublished artifact version(s) left by killed uploads", len(removed))
    return removed
