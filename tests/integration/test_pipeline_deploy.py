"""The real pipeline deployed from deployments/prefect.yaml: server + pool `gpu` + process worker + moto S3.

A `fusion-pipeline` run is created through the API exactly as the UI's run form does (typed `config` parameter),
executed by the worker, and leaves its artifacts in the bucket; then a checkpoint dropped into `incoming/` is seen
by a `watch-checkpoints` run whose `symfuse.checkpoint.arrived` event triggers a `remerge` run that completes.
Slow (two tiny pipeline runs in worker subprocesses): run with `-m slow`.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from symfuse.store import ArtifactStore, layout
from tests.flows.conftest import tiny_config

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def deployed(prefect_server, s3, stack, tmp_path_factory):
    """deployments/prefect.yaml deployed from the repository root, workers on pools `gpu` and `control`.

    The project file's copy whose pull step names this checkout is deployed, as the local stack does.
    """
    stack.apply_api_setup(prefect_server.api_url)
    project = stack.local_project_file(tmp_path_factory.mktemp("project"))
    prefect_server.cli("--no-prompt", "deploy", "--all", "--prefect-file", str(project), cwd=REPO,
                       timeout=300)  # fmt: skip
    env = {**s3.env, "CUDA_VISIBLE_DEVICES": "", "PREFECT_WORKER_QUERY_SECONDS": "2", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1"}  # fmt: skip
    prefect_server.start_worker("gpu", env=env, cwd=REPO, name="gpu-worker-it")
    prefect_server.start_worker("control", env=env, cwd=REPO, name="control-worker-it")
    return s3.make_bucket()


def _runs_of(deployment: str):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    async def read():
        async with get_client() as client:
            deps = await client.read_deployments(
                deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[deployment]))
            )
            return (
                await client.read_flow_runs(
                    deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[deployment]))
                )
                if deps
                else []
            )

    return asyncio.run(read())


def test_pipeline_deployment_runs_and_remerges(prefect_api, deployed, s3, tiny_base, tmp_path):
    from prefect.deployments import run_deployment

    root = f"s3://{deployed}/it"
    config = tiny_config(tiny_base, root, anchor="closest", strategies=["simple", "regmean"],
                         datasets=[{"name": n, "max_train_examples": 16, "max_eval_examples": 16}
                                   for n in ("isear", "meld")])  # fmt: skip
    params = {"config": config.model_dump(mode="json")}
    run = run_deployment("fusion-pipeline/fusion-pipeline", parameters=params, timeout=540)
    assert run.state.is_completed(), f"{run.state}\n{prefect_api.log_tail()}"
    store = ArtifactStore(root, **s3.storage_options)
    for key in (layout.report_key("t"), layout.merged_key("t", "regmean", "matched"), layout.model_key("t", "meld")):
        assert store.exists(key), key
    assert "regmean" in (store.get_dir(layout.report_key("t"), tmp_path / "r") / "report.md").read_text()

    # a new checkpoint arrives: the watcher's event triggers remerge (deployment trigger in prefect.yaml)
    folder = store.get_dir(layout.model_key("t", "meld"), tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "symfuse_version_note": "v2"}))  # new content, new digest
    store.put_dir(layout.incoming_key("t", "meld"), folder, "test", meta={"dataset": "meld"})
    watch = run_deployment("watch-checkpoints/watch-checkpoints", parameters=params, timeout=240)
    assert watch.state.is_completed(), f"{watch.state}\n{prefect_api.log_tail()}"
    deadline, remerges = time.monotonic() + 420, []
    while time.monotonic() < deadline:
        remerges = _runs_of("remerge")
        if remerges and remerges[0].state and remerges[0].state.is_final():
            break
        time.sleep(3)
    assert remerges, f"no remerge run was triggered\n{prefect_api.log_tail()}"
    assert remerges[0].state.is_completed(), f"{remerges[0].state}\n{prefect_api.log_tail()}"
    merged = store.manifest(layout.merged_key("t", "simple", "plain"))
    incoming = layout.manifest_digest(store.manifest(layout.incoming_key("t", "meld")))
    assert incoming in merged["meta"]["model_digests"]
