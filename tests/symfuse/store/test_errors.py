"""Backend errors become builtins with the cause kept."""

from __future__ import annotations

import pytest
from botocore.exceptions import EndpointConnectionError, NoCredentialsError

from symfuse.store import ArtifactNotFound, ArtifactStore, StoreUnreachable
from symfuse.store.errors import translate, translated
from tests.integration.servers import free_port


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (EndpointConnectionError(endpoint_url="http://127.0.0.1:1"), StoreUnreachable),
        (NoCredentialsError(), PermissionError),
        (PermissionError("denied"), PermissionError),
        (FileNotFoundError("gone"), FileNotFoundError),
        (TimeoutError("slow"), StoreUnreachable),
        (RuntimeError("weird"), OSError),
    ],
)
def test_translate_maps_backend_errors_to_builtins(exc, expected):
    with pytest.raises(expected, match="runs/x") as info, translated("s3://b/runs/x"):
        raise exc
    assert info.value.__cause__ is exc
    assert type(translate(exc, "k")) is expected
    assert issubclass(StoreUnreachable, ConnectionError)  # callers catching ConnectionError still catch it


def test_bad_input_is_not_translated():
    with pytest.raises(ValueError, match="bad") as info, translated("k"):
        raise ValueError("bad")
    assert info.value.__cause__ is None


def test_unreachable_s3_endpoint_is_a_connection_error(tmp_path):
    port = free_port()  # nobody listens there
    store = ArtifactStore(
        "s3://bucket/prefix",
        cache_dir=tmp_path,
        key="k",
        secret="s",
        client_kwargs={"endpoint_url": f"http://127.0.0.1:{port}", "region_name": "us-east-1"},
        config_kwargs={"retries": {"max_attempts": 1}, "connect_timeout": 2},
    )
    store.fs.retries = 1  # s3fs's own retry loop (class attribute); botocore's is set by config_kwargs
    with pytest.raises(ConnectionError, match="unreachable") as info:
        store.exists("runs/r/models/a")
    assert info.value.__cause__ is not None


def test_missing_bucket_is_file_not_found(s3_server, tmp_path):
    store = ArtifactStore("s3://no-such-bucket-here/p", cache_dir=tmp_path, **s3_server.storage_options)
    assert not store.exists("runs/r/models/a")
    with pytest.raises(FileNotFoundError) as info:
        store.manifest("runs/r/models/a")
    assert isinstance(info.value, ArtifactNotFound)
    assert info.value.__cause__ is not None
    with pytest.raises(FileNotFoundError) as info:
        store.put_json("runs/r/x", {}, producer="t")
    assert info.value.__cause__ is not None
