"""The run lock: one holder per run id, a waiter gets the slot when it frees, a lost lease never stops the holder."""

from __future__ import annotations

import threading
import time

import pytest

import flows.runtime
from flows.runtime import LOCK_PREFIX, run_lock


def _active_slots(run_id: str) -> int:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_global_concurrency_limit_by_name(f"{LOCK_PREFIX}{run_id}").active_slots


@pytest.fixture
def leases(monkeypatch):
    """Every lease id the run lock was granted, in order."""
    granted = []
    acquire = flows.runtime._acquire

    def recording(*args, **kwargs):
        lease_id = acquire(*args, **kwargs)
        if lease_id is not None:
            granted.append(lease_id)
        return lease_id

    monkeypatch.setattr(flows.runtime, "_acquire", recording)
    return granted


def test_a_waiting_run_takes_the_lock_when_the_holder_leaves(leases, monkeypatch):
    monkeypatch.setattr(flows.runtime, "ACQUIRE_POLL_SECONDS", 0.2)
    held, release, order = threading.Event(), threading.Event(), []

    def holder():
        with run_lock("handover"):
            held.set()
            release.wait(60)
            order.append("holder out")

    thread = threading.Thread(target=holder)
    thread.start()
    assert held.wait(60)
    assert _active_slots("handover") == 1
    threading.Timer(1.0, release.set).start()
    t0 = time.monotonic()
    with run_lock("handover", wait_seconds=60):
        order.append("waiter in")
        waited = time.monotonic() - t0
        assert _active_slots("handover") == 1
    thread.join()
    assert order == ["holder out", "waiter in"]
    assert 0.9 < waited < 30
    assert _active_slots("handover") == 0 and len(leases) == 2


def test_a_lease_the_server_lost_is_taken_again_and_the_block_goes_on(leases, monkeypatch, caplog):
    from prefect.client.orchestration import get_client

    monkeypatch.setattr(flows.runtime, "RENEW_EVERY_SECONDS", 0.2)
    with run_lock("revoked"):
        with get_client(sync_client=True) as client:  # the server forgets the lease (expiry, restart, revocation)
            client.release_concurrency_slots_with_lease(leases[0])
        deadline = time.monotonic() + 30
        while len(leases) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(leases) == 2, "the lost lease was not replaced"
        assert _active_slots("revoked") == 1
    assert "lost this run's lease; taking the slot again" in caplog.text
    assert _active_slots("revoked") == 0
    with run_lock("revoked", wait_seconds=2):  # free at once: nothing leaked, nothing hangs
        assert _active_slots("revoked") == 1
