"""An S3 endpoint that accepts connections and never answers fails fast, with one line naming it and the fix."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from symfuse.store import ArtifactStore, StoreUnreachable
from symfuse.store.s3 import ATTEMPTS_ENV, TIMEOUT_ENV, s3_options


@contextlib.contextmanager
def black_hole(lifetime_s: float = 90) -> Iterator[tuple[str, list[socket.socket]]]:
    """A TCP server on 127.0.0.1 that accepts every connection and never sends a byte.

    Its thread polls a stop flag and ends by itself after ``lifetime_s`` at the latest.
    """
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def serve() -> None:
        end = time.monotonic() + lifetime_s
        while not stop.is_set() and time.monotonic() < end:
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            accepted.append(conn)
        for conn in accepted:
            conn.close()
        server.close()

    thread = threading.Thread(target=serve, name="black-hole", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}", accepted
    finally:
        stop.set()
        thread.join(5)


def timed_exists(store: ArtifactStore, key: str, bound_s: float) -> tuple[BaseException | None, float]:
    """Run ``store.exists(key)`` in a thread; the error it raised and its seconds (fails if still blocked)."""
    result: list = []

    def call() -> None:
        start = time.monotonic()
        try:
            store.exists(key)
            result.append((None, time.monotonic() - start))
        except BaseException as exc:
            result.append((exc, time.monotonic() - start))

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(bound_s)
    assert result, f"exists() still blocked after {bound_s} s"
    return result[0]


def hole_store(endpoint: str, tmp_path) -> ArtifactStore:
    return ArtifactStore(
        "s3://bucket/prefix",
        cache_dir=tmp_path,
        key="k",
        secret="s",
        client_kwargs={"endpoint_url": endpoint, "region_name": "us-east-1"},
        skip_instance_cache=True,
    )


def test_black_hole_endpoint_fails_in_under_30s_with_defaults(tmp_path, monkeypatch):
    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    monkeypatch.delenv(ATTEMPTS_ENV, raising=False)
    with black_hole() as (endpoint, accepted):
        store = hole_store(endpoint, tmp_path)
        exc, seconds = timed_exists(store, "runs/r/models/a", bound_s=45)
    print(f"black hole, defaults: exists() failed after {seconds:.1f} s, {len(accepted)} connections")
    assert accepted, "the client never reached the black hole"
    assert isinstance(exc, StoreUnreachable) and isinstance(exc, ConnectionError), repr(exc)
    assert seconds < 30
    message = str(exc)
    assert "\n" not in message
    assert message.startswith("s3://bucket/prefix/runs/r/models/a: store backend unreachable")
    assert endpoint in message and TIMEOUT_ENV in message and "8 s x 2 attempts" in message
    assert exc.__cause__ is not None


def test_black_hole_timeout_is_configurable(tmp_path, monkeypatch):
    monkeypatch.setenv(TIMEOUT_ENV, "1")
    monkeypatch.setenv(ATTEMPTS_ENV, "1")
    with black_hole() as (endpoint, accepted):
        exc, seconds = timed_exists(hole_store(endpoint, tmp_path), "runs/r/models/a", bound_s=20)
    print(f"black hole, {TIMEOUT_ENV}=1 {ATTEMPTS_ENV}=1: exists() failed after {seconds:.1f} s")
    assert isinstance(exc, StoreUnreachable), repr(exc)
    assert len(accepted) == 1 and seconds < 5
    assert "1 s x 1 attempts" in str(exc)


@pytest.mark.parametrize(("name", "value"), [(TIMEOUT_ENV, "soon"), (TIMEOUT_ENV, "0"), (ATTEMPTS_ENV, "1.5")])
def test_bad_limit_settings_are_one_line_errors(monkeypatch, tmp_path, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=rf"^{name}='{value}' is not a positive .*; set e\.g\. {name}=") as info:
        ArtifactStore("s3://bucket/prefix", cache_dir=tmp_path)
    assert "\n" not in str(info.value)


def test_explicit_config_kwargs_win_over_the_defaults():
    opts, limits, endpoint = s3_options(
        {"config_kwargs": {"read_timeout": 3, "retries": {"max_attempts": 4}}, "endpoint_url": "http://e"}
    )
    assert opts["config_kwargs"] == {"read_timeout": 3, "connect_timeout": 8.0, "retries": {"max_attempts": 4}}
    assert (limits.timeout_s, limits.attempts, endpoint) == (3.0, 5, "http://e")
    assert opts["use_listings_cache"] is False
