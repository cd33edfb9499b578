"""The schedule of deployments/prefect.yaml creates flow runs: the server's scheduler service, not a manual run.

``deployments/stack.py start`` (server, pool, limit, ``prefect deploy``) without workers; the scheduler loop is
shortened to 2 s so the first loop after the deploy comes quickly. Within a bounded time the `watch-checkpoints`
deployment must hold Scheduled runs, one per interval of its schedule, with the deployment's parameters.
This fails when the scheduler cannot insert runs (prefect 3.8.8 with sqlalchemy 2.1: "Can't evaluate bulk DML
statement" in every loop, see the sqlalchemy pin in pyproject.toml).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path

import yaml

from tests.integration.servers import free_port

REPO = Path(__file__).resolve().parents[2]
WATCH = "watch-checkpoints"


def _watch_spec() -> dict:
    data = yaml.safe_load((REPO / "deployments" / "prefect.yaml").read_text())
    (spec,) = [d for d in data["deployments"] if d["name"] == WATCH]
    return spec


def test_watch_schedule_creates_scheduled_runs(stack, tmp_path, monkeypatch):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        DeploymentFilter,
        DeploymentFilterName,
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.settings import PREFECT_API_URL, temporary_settings

    spec = _watch_spec()
    (schedule,) = spec["schedules"]
    assert schedule.get("active", True), "the watcher's schedule is meant to be active"
    interval = float(schedule["interval"])

    monkeypatch.setenv("PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS", "2")  # the server inherits it
    home = tmp_path / "stack"
    info = stack.start(port=free_port(), gpus=[], home=home, workers=False)
    try:
        assert WATCH in info["deployments"]

        async def scheduled():
            async with get_client() as client:
                return await client.read_flow_runs(
                    deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[WATCH])),
                    flow_run_filter=FlowRunFilter(
                        state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.SCHEDULED]))
                    ),
                )

        with temporary_settings(updates={PREFECT_API_URL: info["api_url"]}):
            deadline = time.monotonic() + 60
            runs = asyncio.run(scheduled())
            while not runs and time.monotonic() < deadline:
                time.sleep(1)
                runs = asyncio.run(scheduled())
        log = (home / "logs" / "server.log").read_text(errors="replace")
        tail = "\n".join(log.splitlines()[-40:])
        assert runs, f"the scheduler created no run of {WATCH} within 60 s; server log:\n{tail}"
        assert "bulk DML" not in log, tail
        starts = sorted(run.expected_start_time for run in runs)
        gaps = {(b - a).total_seconds() for a, b in itertools.pairwise(starts)}
        assert len(runs) >= 2 and gaps == {interval}, f"runs not {interval:.0f} s apart: {starts}"
        pool = spec["work_pool"]["name"]  # the watcher's own pool (never a GPU worker's slot)
        assert all(run.work_pool_name == pool and run.auto_scheduled for run in runs)
        assert runs[0].parameters["config"]["run_id"] == spec["parameters"]["config"]["run_id"]
    finally:
        stack.stop(home)
