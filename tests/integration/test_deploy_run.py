"""Deploy a tiny flow to pool `gpu` with a real server and a process worker; run it through the API as the UI does.

The flow writes into a moto S3 bucket through the ArtifactStore, finding the endpoint in the worker's AWS_*
environment. A second run kills its own process on the first attempt: the worker reports it Crashed and the
`symfuse-reschedule-crashed` automation (deployments/automations.yaml) puts it back to Scheduled, so it completes.
"""

from __future__ import annotations

import asyncio
import textwrap
import time

import pytest
import yaml

from symfuse.store import ArtifactStore

FLOW = """
import os
from pathlib import Path

from prefect import flow

from symfuse.store import ArtifactStore


@flow(name="tiny")
def tiny(store_root: str, key: str, crash_marker: str = "") -> str:
    if crash_marker and not Path(crash_marker).exists():
        Path(crash_marker).write_text("crashed once")
        os._exit(17)  # the flow-run process dies without reporting: the worker marks the run Crashed
    info = {"cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "pid": os.getpid()}
    return ArtifactStore(store_root).put_json(key, info, producer="tiny")
"""


@pytest.fixture(scope="module")
def deployed(prefect_server, s3, stack, tmp_path_factory):
    """The tiny flow deployed (via prefect.yaml) to pool `gpu`, with one process worker on 'GPU 0'."""
    project = tmp_path_factory.mktemp("tiny-project")
    (project / "tiny.py").write_text(textwrap.dedent(FLOW))
    spec = {
        "name": "tiny-project",
        "prefect-version": "3.8.8",
        "deployments": [
            {
                "name": "tiny",
                "entrypoint": "tiny.py:tiny",
                "tags": ["symfuse"],
                "work_pool": {"name": "gpu"},
            }
        ],
    }
    (project / "prefect.yaml").write_text(yaml.safe_dump(spec))
    stack.apply_api_setup(prefect_server.api_url)
    prefect_server.cli("deploy", "--all", "--prefect-file", str(project / "prefect.yaml"), cwd=project)
    env = {**s3.env, "CUDA_VISIBLE_DEVICES": "0", "PREFECT_WORKER_QUERY_SECONDS": "2"}
    worker = prefect_server.start_worker("gpu", env=env, cwd=project, name="gpu-worker-0")
    yield s3.make_bucket()
    prefect_server.stop_worker(worker)  # later modules start their own workers on the same pool


def _store(s3, bucket) -> ArtifactStore:
    return ArtifactStore(f"s3://{bucket}/it", **s3.storage_options)


def test_pool_queue_and_automations_exist(prefect_api, deployed):
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    async def read():
        async with get_client() as client:
            pool = await client.read_work_pool("gpu")
            queue = await client.read_work_queue_by_name("stages", work_pool_name="gpu")
            try:  # no global `gpu` tag limit: each worker's device slots bound its heavy tasks (tasks/devices.py)
                limit = await client.read_concurrency_limit_by_tag("gpu")
            except ObjectNotFound:
                limit = None
            autos = [await client.read_automations_by_name(n) for n in ("symfuse-reschedule-crashed",
                                                                        "symfuse-crash-zombies")]  # fmt: skip
            return pool, queue, limit, autos

    pool, queue, limit, autos = asyncio.run(read())
    assert pool.type == "process" and queue.name == "stages"
    assert limit is None
    assert all(len(a) == 1 and a[0].enabled for a in autos)


def test_run_through_api_completes_and_writes_to_s3(prefect_api, deployed, s3):
    from prefect.deployments import run_deployment

    store = _store(s3, deployed)
    key = "runs/it/report"
    run = run_deployment("tiny/tiny", parameters={"store_root": store.root, "key": key}, timeout=240)
    assert run.state.is_completed(), f"{run.state}\n{prefect_api.log_tail()}"
    assert store.exists(key)
    assert store.get_json(key)["cuda_visible_devices"] == "0"  # the worker's GPU reaches its flow runs


def test_crashed_run_is_rescheduled_and_completes(prefect_api, deployed, s3, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    store = _store(s3, deployed)
    key = "runs/it/crashed-once"
    marker = tmp_path / "crashed"
    params = {"store_root": store.root, "key": key, "crash_marker": str(marker)}
    run = run_deployment("tiny/tiny", parameters=params, timeout=240)
    assert marker.exists(), f"first attempt did not run: {run.state}\n{prefect_api.log_tail()}"

    async def states():
        async with get_client() as client:
            return await client.read_flow_run_states(run.id)

    deadline = time.monotonic() + 180
    history = []
    while time.monotonic() < deadline:
        history = asyncio.run(states())
        if history and history[-1].is_completed():
            break
        time.sleep(2)
    kinds = [s.type.value for s in history]
    assert "CRASHED" in kinds, kinds
    assert kinds[-1] == "COMPLETED", f"{kinds}\n{prefect_api.log_tail()}"
    assert store.exists(key)
