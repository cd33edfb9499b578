"""Store fixtures: one ``store`` per backend (memory://, a local folder, a moto S3 server on 127.0.0.1)."""

from __future__ import annotations

import uuid

import pytest

from symfuse.store import ArtifactStore
from tests.integration.servers import S3Server, moto_s3_server

BACKENDS = ["memory", "local", "s3"]


@pytest.fixture(scope="session")
def s3_server() -> S3Server:
    """A moto S3 server shared by the session."""
    with moto_s3_server() as server:
        yield server


@pytest.fixture(scope="session")
def s3_bucket(s3_server: S3Server) -> str:
    """One bucket for the session; each test gets its own prefix in it."""
    return s3_server.make_bucket()


def make_store(backend: str, tmp_path, request) -> ArtifactStore:
    cache = tmp_path / "cache"
    if backend == "memory":
        return ArtifactStore(f"memory://symfuse-{uuid.uuid4().hex[:10]}", cache_dir=cache)
    if backend == "local":
        return ArtifactStore(str(tmp_path / "store"), cache_dir=cache)
    server = request.getfixturevalue("s3_server")
    bucket = request.getfixturevalue("s3_bucket")
    return ArtifactStore(f"s3://{bucket}/t-{uuid.uuid4().hex[:10]}", cache_dir=cache, **server.storage_options)


@pytest.fixture(params=BACKENDS)
def store(request, tmp_path) -> ArtifactStore:
    """A fresh, empty store on each backend."""
    return make_store(request.param, tmp_path, request)
