"""deployments/stack.py for real: start (server, pool, limit, prefect deploy of deployments/prefect.yaml,
automations), the remerge trigger fed by a `symfuse.checkpoint.arrived` event, then stop.

Started without workers, so the triggered remerge run is created (and inspected) but not executed.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

from symfuse.config import RunConfig
from tests.integration.servers import free_port


def test_local_stack_deploys_and_triggers_remerge(stack, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.exceptions import ObjectNotFound
    from prefect.settings import PREFECT_API_URL, temporary_settings

    home = tmp_path / "stack"
    info = stack.start(port=free_port(), gpus=[], home=home, workers=False)
    try:
        expected, _missing = stack.deployable_names()
        assert info["deployments"] == expected
        assert stack.status(home) == {"server": True}
        config = RunConfig.demo(quick=True).model_dump(mode="json")
        checkpoints = ["s3://bucket/runs/demo-quick/incoming/ckpt-1"]
        payload = json.dumps({"config": config, "checkpoints": checkpoints})
        env = stack.server_env(home, info["api_url"])
        subprocess.run(
            [sys.executable, "-m", "prefect", "event", "emit", "symfuse.checkpoint.arrived",
             "--resource-id", "symfuse.run.demo-quick", "--payload", payload],
            env=env, check=True, capture_output=True, timeout=120,
        )  # fmt: skip

        async def read():
            async with get_client() as client:
                deps = {d.name: d for d in await client.read_deployments()}
                autos = await client.read_automations()
                try:  # no global `gpu` tag limit: each worker's device slots bound its heavy tasks
                    limit = await client.read_concurrency_limit_by_tag("gpu")
                except ObjectNotFound:
                    limit = None
                runs = []
                if "remerge" in deps:
                    runs = await client.read_flow_runs(
                        deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deps["remerge"].id]))
                    )
                return deps, autos, limit, runs

        with temporary_settings(updates={PREFECT_API_URL: info["api_url"]}):
            deadline = time.monotonic() + 90
            while True:
                deps, autos, limit, runs = asyncio.run(read())
                if runs or "remerge" not in deps or time.monotonic() > deadline:
                    break
                time.sleep(1)
        assert set(deps) == set(expected)
        pools = {"watch-checkpoints": "control"}  # the watcher's own pool; every other deployment runs on `gpu`
        assert {n: d.work_pool_name for n, d in deps.items()} == {n: pools.get(n, "gpu") for n in deps}
        for dep in deps.values():  # the flows run in this checkout (the project file's step names /opt/symfuse)
            assert dep.pull_steps == [
                {"prefect.deployments.steps.set_working_directory": {"directory": str(stack.REPO)}}
            ], dep.name
        assert limit is None
        assert {"symfuse-reschedule-crashed", "symfuse-crash-zombies"} <= {a.name for a in autos}
        if "remerge" in deps:
            assert len(runs) == 1, "the event did not trigger remerge"
            assert runs[0].parameters["checkpoints"] == checkpoints  # a list, not its text
            assert RunConfig.model_validate(runs[0].parameters["config"]) == RunConfig.demo(quick=True)
    finally:
        stopped = stack.stop(home)
    assert stopped == [info["server_pid"]]
    assert stack.status(home) == {}


def test_stack_on_another_port_restarts_at_once_and_keeps_ui_edits(stack, tmp_path):
    """The UI calls the API on --port; stop then start at once works; the second start deploys nothing and keeps a
    parameter edited through the API (as the UI does) and the watcher's schedule."""
    import urllib.request

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import DeploymentUpdate
    from prefect.settings import PREFECT_API_URL, temporary_settings

    home, port = tmp_path / "stack", free_port()
    info = stack.start(port=port, gpus=[], home=home, workers=False)
    try:
        with urllib.request.urlopen(f"{info['ui']}/ui-settings", timeout=10) as resp:
            assert json.load(resp)["api_url"] == info["api_url"] == f"http://127.0.0.1:{port}/api"
        edited = RunConfig.demo().model_dump(mode="json") | {"run_id": "edited-in-ui"}

        async def edit_and_read(edit: bool):
            async with get_client() as client:
                dep = await client.read_deployment_by_name("watch-checkpoints/watch-checkpoints")
                if edit:
                    await client.update_deployment(dep.id, DeploymentUpdate(parameters={"config": edited}))
                    dep = await client.read_deployment_by_name("watch-checkpoints/watch-checkpoints")
                return dep.parameters, [(s.id, s.schedule.anchor_date) for s in dep.schedules]

        with temporary_settings(updates={PREFECT_API_URL: info["api_url"]}):
            params, schedules = asyncio.run(edit_and_read(edit=True))
        assert params["config"]["run_id"] == "edited-in-ui"
    finally:
        stack.stop(home)
    started = time.monotonic()
    again = stack.start(port=port, gpus=[], home=home, workers=False)  # at once: the old connections are in TIME_WAIT
    try:
        assert time.monotonic() - started < 50
        report = again["deploy"]
        assert report["deployed"] == [] and report["kept"] == ["watch-checkpoints"], report
        assert set(report["unchanged"]) == set(info["deployments"]) - {"watch-checkpoints"}
        assert any(line.startswith("kept watch-checkpoints as edited on the server (parameters)") for line in
                   report["lines"])  # fmt: skip
        with temporary_settings(updates={PREFECT_API_URL: again["api_url"]}):
            assert asyncio.run(edit_and_read(edit=False)) == (params, schedules)
    finally:
        stack.stop(home)
