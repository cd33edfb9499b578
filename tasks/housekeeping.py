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
    of processes that are gone (a SIGKILLed task) are removed from this machine's temporary folder too.

    Returns:
        The URIs of the removed version folders.
    """
    clean_stale_scratch()
    removed = open_store(config).gc(layout.run_prefix(config.run_id))
    if removed:
        logger().info("removed %d unpublished artifact version(s) left by killed uploads", len(removed))
    return removed
