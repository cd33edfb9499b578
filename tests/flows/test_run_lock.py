"""The run lock: one holder per run id, a waiter gets the slot when it frees, a lost lease never stops the holder;
a rescheduled attempt of the holder's own flow run takes the lock over at once (tested against a fake server)."""

from __future__ import annotations

import logging
import threading
import time
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from types import SimpleNamespace
from uuid import UUID, uuid4

import httpx
import pytest

import flows.runtime
from flows.runtime import LOCK_PREFIX, holder_variable, run_lock, takes_over


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


# ------------------------------------------------------------------ takeover by a later attempt (no server: a fake one)
class _FakeServer:
    """Global concurrency limits of one slot with leases, and variables: what the run lock asks of Prefect."""

    def __init__(self, attempt: int) -> None:
        self.leases: dict[UUID, str] = {}
        self.variables: dict[str, dict] = {}
        self.updated: dict[str, datetime] = {}  # when each variable was last written, by the server's clock
        self.attempt = attempt  # the run_count the server reports for the current flow run
        self.released: list[UUID] = []
        self.reset: list[str] = []  # limits whose slot count was set to 0

    def hold(self, name: str) -> UUID:
        lease = uuid4()
        self.leases[lease] = name
        return lease


class _FakeClient:
    def __init__(self, server: _FakeServer) -> None:
        self.server = server

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    @staticmethod
    def _error(code: int) -> httpx.HTTPStatusError:
        request = httpx.Request("POST", "http://fake/api")
        return httpx.HTTPStatusError(str(code), request=request, response=httpx.Response(code, request=request))

    def read_global_concurrency_limit_by_name(self, name):
        return SimpleNamespace(name=name)

    def increment_concurrency_slots_with_lease(self, names, slots, mode, lease_duration, holder=None):
        if names[0] in self.server.leases.values():
            raise self._error(423)
        return httpx.Response(200, json={"lease_id": str(self.server.hold(names[0]))})

    def renew_concurrency_lease(self, lease_id, lease_duration):
        if lease_id not in self.server.leases:
            raise self._error(410)

    def release_concurrency_slots_with_lease(self, lease_id):
        self.server.released.append(lease_id)
        if self.server.leases.pop(lease_id, None) is None:
            raise self._error(404)

    def update_global_concurrency_limit(self, name, concurrency_limit):  # active_slots=0: every slot of it freed
        self.server.reset.append(name)
        for lease in [k for k, v in self.server.leases.items() if v == name]:
            del self.server.leases[lease]

    def read_variable_by_name(self, name):
        value = self.server.variables.get(name)
        updated = self.server.updated.get(name, datetime.now(UTC))
        return None if value is None else SimpleNamespace(name=name, value=value, updated=updated)

    def request(self, method, path):  # the server's clock, in the Date header of any answer
        return httpx.Response(200, headers={"date": format_datetime(datetime.now(UTC), usegmt=True)})

    def create_variable(self, variable):
        self.update_variable(variable)

    def update_variable(self, variable):
        self.server.variables[variable.name] = variable.value
        self.server.updated[variable.name] = datetime.now(UTC)

    def delete_variable_by_name(self, name):
        self.server.variables.pop(name, None)

    def read_flow_run(self, flow_run_id):
        return SimpleNamespace(id=flow_run_id, run_count=self.server.attempt)


FLOW_RUN = UUID("00000000-0000-4000-8000-000000000001")


@pytest.fixture
def fake(monkeypatch):
    """A fake server; run_lock runs as attempt ``fake.attempt`` of flow run FLOW_RUN against it."""
    import prefect.client.orchestration
    import prefect.context

    server = _FakeServer(attempt=2)
    monkeypatch.setattr(prefect.client.orchestration, "get_client", lambda sync_client=False: _FakeClient(server))
    flow_run = SimpleNamespace(id=FLOW_RUN, run_count=1)  # the context's count is stale; the server's is current
    monkeypatch.setattr(
        prefect.context.FlowRunContext, "get", classmethod(lambda cls: SimpleNamespace(flow_run=flow_run))
    )
    monkeypatch.setattr(flows.runtime, "_logger", lambda: logging.getLogger("flows"))
    monkeypatch.setattr(flows.runtime, "ACQUIRE_POLL_SECONDS", 0.05)
    monkeypatch.setattr(flows.runtime, "QUIET_SECONDS", 0.5)
    return server


def _record(server: _FakeServer, name: str, flow_run, attempt: int, lease, beat: int = 0) -> None:
    server.variables[holder_variable(name)] = {"flow_run": str(flow_run), "attempt": attempt, "lease": str(lease),
                                               "beat": beat}  # fmt: skip


@pytest.mark.parametrize(
    ("holder", "me", "expected"),
    [
        ({"flow_run": "a", "attempt": 1, "lease": "x"}, {"flow_run": "a", "attempt": 2}, True),
        ({"flow_run": "a", "attempt": 2, "lease": "x"}, {"flow_run": "a", "attempt": 2}, False),  # itself: re-entry
        ({"flow_run": "a", "attempt": 3, "lease": "x"}, {"flow_run": "a", "attempt": 2}, False),  # a later attempt
        ({"flow_run": "b", "attempt": 1, "lease": "x"}, {"flow_run": "a", "attempt": 2}, False),  # another run
        (None, {"flow_run": "a", "attempt": 2}, False),
        ({"flow_run": "a", "attempt": 1, "lease": "x"}, None, False),  # outside a flow run
        ({"attempt": "one"}, {"flow_run": "a", "attempt": 2}, False),  # a record written by something else
    ],
)
def test_only_a_later_attempt_of_the_same_flow_run_takes_over(holder, me, expected):
    assert takes_over(holder, me) is expected


def test_a_rescheduled_attempt_takes_its_dead_attempts_lock_once_its_beat_stopped(fake, caplog):
    name = f"{LOCK_PREFIX}crashed"
    dead = fake.hold(name)  # attempt 1 died holding the slot: its lease would run for up to a minute
    _record(fake, name, FLOW_RUN, 1, dead, beat=7)
    caplog.set_level(logging.INFO, logger="flows")
    t0 = time.monotonic()
    with run_lock("crashed", wait_seconds=5):
        assert 0.5 <= time.monotonic() - t0 < 3  # QUIET_SECONDS of a still beat, not the lease's minute
        assert dead not in fake.leases and list(fake.leases.values()) == [name]
        assert fake.variables[holder_variable(name)]["attempt"] == 2
    assert "held by attempt 1 of this same flow run, which is gone (this is attempt 2); taking it over" in caplog.text
    assert fake.leases == {} and fake.variables == {}, "released, and the holder record with it"


def test_another_flow_run_holding_the_lock_is_waited_for(fake):
    name = f"{LOCK_PREFIX}busy"
    _record(fake, name, uuid4(), 1, fake.hold(name))
    busy = pytest.raises(RuntimeError, match=r"run_id 'busy' is in use by another flow run")
    with busy, run_lock("busy", wait_seconds=0.3):
        pass
    assert fake.released == []


def test_an_earlier_attempt_never_takes_the_lock_from_a_later_one(fake):
    name = f"{LOCK_PREFIX}later"
    fake.attempt = 1
    _record(fake, name, FLOW_RUN, 2, fake.hold(name))
    with pytest.raises(RuntimeError, match="in use by another flow run"), run_lock("later", wait_seconds=0.3):
        pass
    assert fake.released == []


def test_a_record_already_quiet_by_the_servers_clock_is_taken_over_at_once(fake, monkeypatch):
    monkeypatch.setattr(flows.runtime, "QUIET_SECONDS", 30.0)
    name = f"{LOCK_PREFIX}long-dead"
    dead = fake.hold(name)
    _record(fake, name, FLOW_RUN, 1, dead, beat=3)
    fake.updated[holder_variable(name)] = datetime.now(UTC) - timedelta(seconds=45)  # six beats missed
    t0 = time.monotonic()
    with run_lock("long-dead", wait_seconds=5):
        assert time.monotonic() - t0 < 2 and dead not in fake.leases
    fake.hold(name)  # a fresh record (last beat just now) of attempt 1 is waited for: it may be alive
    _record(fake, name, FLOW_RUN, 1, uuid4(), beat=4)
    with pytest.raises(RuntimeError, match="in use by another flow run"), run_lock("long-dead", wait_seconds=1):
        pass


def test_an_earlier_attempt_that_still_beats_is_waited_for(fake):
    """A duplicate of the run Prefect started next to this one (a crash reported twice) finishes first."""
    name = f"{LOCK_PREFIX}alive"
    lease, stop = fake.hold(name), threading.Event()
    _record(fake, name, FLOW_RUN, 1, lease)

    def beating():  # what attempt 1's lease keeper does at every renewal
        beat = 0
        while not stop.wait(0.1):
            beat += 1
            _record(fake, name, FLOW_RUN, 1, lease, beat)

    threading.Thread(target=beating, daemon=True).start()
    try:
        with pytest.raises(RuntimeError, match="in use by another flow run"), run_lock("alive", wait_seconds=1.5):
            pass
    finally:
        stop.set()
    assert fake.released == [] and lease in fake.leases


def test_a_holder_killed_longer_ago_than_its_lease_is_taken_over_whoever_it_was(fake, caplog):
    """After a SIGKILL the next command's server read the slot as taken from its database, with the lease (kept in
    the killed server's memory) gone: the same run id waited forever, without a word."""
    name = f"{LOCK_PREFIX}killed"
    fake.hold(name)  # the slot as the database has it: under no lease this server knows
    other = uuid4()
    _record(fake, name, other, 1, uuid4(), beat=12)
    fake.updated[holder_variable(name)] = datetime.now(UTC) - timedelta(seconds=flows.runtime.LEASE_SECONDS + 31)
    caplog.set_level(logging.INFO, logger="flows")
    t0 = time.monotonic()
    with run_lock("killed", wait_seconds=5):
        assert time.monotonic() - t0 < 2 and list(fake.leases.values()) == [name]
    assert fake.reset == [name] and f"held by flow run {other}, attempt 1, whose last beat was" in caplog.text
    _record(fake, name, other, 1, fake.hold(name), beat=13)  # a record written just now: alive, waited for
    with pytest.raises(RuntimeError, match="in use by another flow run"), run_lock("killed", wait_seconds=1):
        pass
    assert fake.reset == [name]


def test_a_stale_holder_record_is_tried_once_then_waited_for(fake):
    name = f"{LOCK_PREFIX}stale"
    fake.hold(name)  # held by someone who left no record; the record names a lease long gone
    gone = uuid4()
    _record(fake, name, FLOW_RUN, 1, gone)
    with pytest.raises(RuntimeError, match="in use by another flow run"), run_lock("stale", wait_seconds=1.5):
        pass
    assert fake.released == [gone], "the recorded lease is released once, not in a loop"


def test_the_holder_of_a_flow_run_records_itself_and_beats_while_it_holds(monkeypatch):
    from prefect import flow
    from prefect.client.orchestration import get_client

    monkeypatch.setattr(flows.runtime, "RENEW_EVERY_SECONDS", 0.2)
    var = holder_variable(f"{LOCK_PREFIX}beating")

    def record():
        with get_client(sync_client=True) as client:
            variable = client.read_variable_by_name(var)
            return None if variable is None else variable.value

    @flow
    def holder_flow():
        from prefect.context import FlowRunContext

        with run_lock("beating"):
            first = record()
            time.sleep(1.5)
            return str(FlowRunContext.get().flow_run.id), first, record()

    flow_run, first, later = holder_flow()
    assert (first["flow_run"], first["attempt"], first["beat"]) == (flow_run, 1, 0)
    assert later["lease"] == first["lease"] and later["beat"] >= 3, later
    assert record() is None, "released with the lock"


def test_a_records_age_is_read_off_the_servers_clock(monkeypatch):
    from prefect import flow
    from prefect.client.orchestration import get_client

    monkeypatch.setattr(flows.runtime, "RENEW_EVERY_SECONDS", 60.0)  # no beat while we watch

    @flow
    def silent_holder():
        with run_lock("silent"):
            time.sleep(3.0)
            with get_client(sync_client=True) as client:
                return flows.runtime._read_holder_and_age(client, f"{LOCK_PREFIX}silent")

    holder, age = silent_holder()
    # the Date header has whole seconds and the record is written a moment after the lock is taken (later under
    # load): the age is positive and below the takeover time, never the 0 of an unreadable clock
    assert holder["beat"] == 0 and 0 < age < 30, age
