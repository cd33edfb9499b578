"""Integration fixtures: a real Prefect server and a moto S3 server on 127.0.0.1 (every test here is `integration`).

- ``prefect_server`` (session): ``prefect server start --host 127.0.0.1 --port <free>`` with a temporary PREFECT_HOME
  and sqlite database, healthy before the first test; its handle (:class:`~tests.integration.servers.PrefectServer`)
  runs CLI commands (``.cli("deploy", ...)``) and starts process workers (``.start_worker(pool="gpu", env=...)``)
  that are stopped BEFORE the server at teardown (workers hang on SIGTERM once their server is gone).
- ``prefect_api`` (function): the same handle, with this process's PREFECT_API_URL pointing at that server, so
  ``run_deployment`` and ``get_client`` talk to it (as the UI does, through the API).
- ``s3`` (session): a moto S3 server; ``s3.env`` gives workers the AWS_* variables the store reads,
  ``s3.make_bucket()`` a fresh bucket.
- ``stack`` (session): ``deployments/stack.py`` loaded as a module (``stack.apply_api_setup(api_url)`` creates pool
  ``gpu``, its ``stages`` queue and the automations of ``deployments/automations.yaml``).

Example (a deploy-and-run test)::

    def test_pipeline_runs(prefect_api, s3, stack, tmp_path):
        stack.apply_api_setup(prefect_api.api_url)
        prefect_api.cli("deploy", "--all", "--prefect-file", str(yaml_file), cwd=project_dir)
        prefect_api.start_worker("gpu", env=s3.env)
        run = run_deployment("fusion-pipeline/fusion-pipeline", parameters=..., timeout=600)
        assert run.state.is_completed(), prefect_api.log_tail()
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from tests.integration.servers import PrefectServer, S3Server, moto_s3_server
from tests.integration.servers import prefect_server as _prefect_server

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if Path(str(item.fspath)).resolve().is_relative_to(HERE):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory) -> PrefectServer:
    """A real Prefect server for the session (temp PREFECT_HOME, sqlite); workers are stopped before it."""
    with _prefect_server(tmp_path_factory.mktemp("prefect-home")) as server:
        yield server


@pytest.fixture
def prefect_api(prefect_server: PrefectServer) -> PrefectServer:
    """``prefect_server`` with this process's Prefect settings pointing at it for the test's duration."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: prefect_server.api_url}):
        yield prefect_server


@pytest.fixture(scope="session")
def s3() -> S3Server:
    """A moto S3 server for the session."""
    with moto_s3_server() as server:
        yield server


@pytest.fixture(scope="session")
def stack() -> ModuleType:
    """``deployments/stack.py`` as a module."""
    spec = importlib.util.spec_from_file_location("symfuse_deploy_stack", REPO / "deployments" / "stack.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory) -> Path:
    """A tiny random BERT with the real MiniLM tokenizer files (the deployed pipelines fine-tune it)."""
    import shutil

    from symfuse.checkpoint import default_base_model
    from tests.flows.conftest import TOKENIZER_FILES
    from tests.tiny import save_tiny

    folder = save_tiny(tmp_path_factory.mktemp("base") / "bert", "bert", vocab_size=30522, max_position_embeddings=64)
    for name in TOKENIZER_FILES:
        shutil.copy2(default_base_model() / name, folder / name)
    return folder
