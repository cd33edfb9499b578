"""Store housekeeping at the start of a run: versions that killed uploads left behind are removed."""

from __future__ import annotations

from symfuse.config import RunConfig
from symfuse.store import layout
from tasks.common import logger, open_store, symfuse_task


@symfuse_task(name="clean-store", task_run_name="clean-store-{config.run_id}")
def clean_store(config: RunConfig) -> list[str]:
    """Remove this run's unpublished artifact versions older than the store's grace period.

    A killed upload leaves a version folder that no manifest names (never readable); the next run of the same
    ``run_id`` collects it. Published versions and young ones (a live writer's) are never touched.

    Returns:
        The URIs of the removed version folders.
    """
    removed = open_store(config).gc(layout.run_prefix(config.run_id))
    if removed:
        logger().info("removed %d unpublished artifact version(s) left by killed uploads", len(removed))
    return removed
