"""Device slots (tasks/devices.py): a machine's heavy tasks share its devices, one task per slot, pinned to it."""

from __future__ import annotations

import threading
import time

import pytest

from symfuse.config import RunConfig
from tasks.common import symfuse_task
from tasks.devices import device_slot, slot_devices, slot_names, task_device


def test_a_cpu_machine_has_as_many_slots_as_it_is_told(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert slot_devices("3") == [("cpu0", "cpu"), ("cpu1", "cpu"), ("cpu2", "cpu")]
    assert slot_names("box", slot_devices("2")) == ["symfuse-device-box-cpu0", "symfuse-device-box-cpu1"]
    with pytest.raises(ValueError, match=r"SYMFUSE_CPU_SLOTS='0': give the number of heavy tasks"):
        slot_devices("0")


def test_the_slot_decides_the_device_only_where_the_config_leaves_it_open(monkeypatch, tiny_base):
    monkeypatch.setenv("SYMFUSE_DEVICE_SLOTS", "box")
    auto = RunConfig.model_validate({"base_model": str(tiny_base), "datasets": [{"name": "isear"}], "device": "auto"})
    cpu = auto.model_copy(update={"device": "cpu"})
    assert task_device(auto) == auto.resolved_device()  # outside a slot: the config's device
    with device_slot() as device:
        assert device == "cpu"
        assert task_device(auto) == "cpu" and task_device(cpu) == "cpu"


def test_no_machine_named_no_slot_taken(monkeypatch):
    monkeypatch.delenv("SYMFUSE_DEVICE_SLOTS", raising=False)
    with device_slot() as device:
        assert device is None


def _most_at_once(machine: str, tasks: int) -> int:
    """Run ``tasks`` threads that each hold a slot of ``machine`` for 1 s; how many held one at the same time."""
    lock, now, most = threading.Lock(), [0], [0]

    def work():
        with device_slot(machine):
            with lock:
                now[0] += 1
                most[0] = max(most[0], now[0])
            time.sleep(1.0)
            with lock:
                now[0] -= 1

    threads = [threading.Thread(target=work) for _ in range(tasks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return most[0]


def test_one_heavy_task_per_slot_on_a_machine(monkeypatch):
    import tasks.devices

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(tasks.devices, "POLL_SECONDS", 0.2)
    monkeypatch.setenv("SYMFUSE_CPU_SLOTS", "1")
    t0 = time.monotonic()
    most = _most_at_once("one-slot", 2)
    assert most == 1 and time.monotonic() - t0 >= 2.0  # the second waited for the first
    monkeypatch.setenv("SYMFUSE_CPU_SLOTS", "2")
    assert _held_together("two-slots", 2)  # side by side: each waits inside its slot for the other to arrive


def _held_together(machine: str, tasks: int, timeout: float = 30.0) -> bool:
    """Whether ``tasks`` threads each holding a slot of ``machine`` were all inside their slots at one time.

    A barrier inside the slot, not a clock: on a loaded machine a thread may start late, but it still finds the
    other's slot held and takes the free one.
    """
    barrier = threading.Barrier(tasks, timeout=timeout)
    met: list[bool] = []

    def work():
        with device_slot(machine):
            try:
                barrier.wait()
                met.append(True)
            except threading.BrokenBarrierError:
                met.append(False)

    threads = [threading.Thread(target=work) for _ in range(tasks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 30)
    return met == [True] * tasks


def test_a_gpu_task_holds_a_slot_and_keeps_its_signature(monkeypatch):
    import inspect

    monkeypatch.setenv("SYMFUSE_DEVICE_SLOTS", "task-box")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    seen = []

    @symfuse_task("probe", "probe-{x}", gpu=True)
    def probe(config: RunConfig, x: int) -> str:
        seen.append(task_device(config))
        return "ok"

    assert list(inspect.signature(probe.fn).parameters) == ["config", "x"]
    config = RunConfig.model_validate({"base_model": "minilm", "datasets": [{"name": "isear"}], "device": "auto"})
    assert probe.fn(config, 1) == "ok" and seen == ["cpu"]
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        limit = client.read_global_concurrency_limit_by_name("symfuse-device-task-box-cpu0")
    assert (limit.limit, limit.active_slots) == (1, 0), "created with one slot, released after the task"


def test_a_task_that_reuses_its_result_waits_for_no_slot(monkeypatch):
    import tasks.devices

    monkeypatch.setenv("SYMFUSE_DEVICE_SLOTS", "busy-box")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("SYMFUSE_CPU_SLOTS", "1")
    monkeypatch.setattr(tasks.devices, "POLL_SECONDS", 0.2)

    @symfuse_task("probe_reuse", "probe-reuse-{stored}", gpu=True)
    def probe(config: RunConfig, stored: bool) -> str:
        if stored:  # what a task's store lookup finds: no device asked for
            return "reused"
        return f"computed on {task_device(config)}"

    config = RunConfig.model_validate({"base_model": "minilm", "datasets": [{"name": "isear"}], "device": "auto"})
    reused: list[str] = []
    result: list[str] = []
    with device_slot():  # another task holds the machine's only slot
        lookup = threading.Thread(target=lambda: reused.append(probe.fn(config, True)))
        lookup.start()
        lookup.join(5)
        assert reused == ["reused"], "a reused result waited for the busy slot"
        computing = threading.Thread(target=lambda: result.append(probe.fn(config, False)))
        computing.start()
        computing.join(1.5)
        assert computing.is_alive() and not result, "a task that computes waits for the slot"
    computing.join(30)
    assert result == ["computed on cpu"]
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        limit = client.read_global_concurrency_limit_by_name("symfuse-device-busy-box-cpu0")
    assert limit.active_slots == 0, "the slot is released when the task returns"
