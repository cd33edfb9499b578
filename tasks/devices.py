"""Device slots: a ``gpu`` task on a worker holds one of its machine's devices and runs on that device.

Prefect's per-worker concurrency pattern (global concurrency limits named after the worker's resources, coordinated
by the server across the separate processes flow runs execute in): a worker started with
``SYMFUSE_DEVICE_SLOTS=<machine>`` gives its flow runs one one-slot limit per device, ``symfuse-device-<machine>-<d>``
— one per GPU they see, ``<d>`` its physical index (``CUDA_VISIBLE_DEVICES``), computing on ``cuda:<k>``; on a
machine without a GPU ``$SYMFUSE_CPU_SLOTS`` (default 1) slots ``cpu<k>``, computing on ``cpu``. A ``gpu`` task
(``symfuse_task(..., gpu=True)``) takes the first free slot when it first asks for its device (:func:`task_device`,
after its store lookup: a task that reuses a stored result takes none), waits while all are busy, and computes on
that slot's device when the run config says ``auto`` or ``cuda``. Workers of one machine name the same
``<machine>`` (they share its devices); each machine its own, so N machines run N heavy tasks at once. The slot is a
lease renewed while the task runs: a killed process frees it within :data:`LEASE_SECONDS`.

Without ``SYMFUSE_DEVICE_SLOTS`` (the in-process path, the CLI, tests) nothing is acquired and nothing changes.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from uuid import UUID

from symfuse.config import RunConfig

MACHINE_ENV = "SYMFUSE_DEVICE_SLOTS"
CPU_SLOTS_ENV = "SYMFUSE_CPU_SLOTS"
SLOT_PREFIX = "symfuse-device-"
LEASE_SECONDS = 60.0  # the shortest lease Prefect allows: a dead holder's slot is free a minute later
RENEW_EVERY_SECONDS = 15.0
POLL_SECONDS = 2.0
_PINNED: contextvars.ContextVar[str | None] = contextvars.ContextVar("symfuse_device", default=None)
_PENDING: contextvars.ContextVar[_SlotOnDemand | None] = contextvars.ContextVar("symfuse_slot", default=None)
log = logging.getLogger("tasks.devices")


def slot_devices(cpu_slots: str | None = None) -> list[tuple[str, str]]:
    """``(slot id, device)`` of this process's slots.

    ``(<physical index>, cuda:<k>)`` per visible GPU, else ``(cpu<k>, cpu)`` ``$SYMFUSE_CPU_SLOTS`` times.

    Raises:
        ValueError: if ``SYMFUSE_CPU_SLOTS`` is not a positive integer (names it and the fix).
    """
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        visible = [g.strip() for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
        count = torch.cuda.device_count()
        physical = visible[:count] if len(visible) >= count else [str(k) for k in range(count)]
        return [(physical[k], f"cuda:{k}") for k in range(count)]
    text = os.environ.get(CPU_SLOTS_ENV, "1") if cpu_slots is None else cpu_slots
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError(f"{CPU_SLOTS_ENV}={text!r}: give the number of heavy tasks a CPU worker runs at once (>= 1)")
    return [(f"cpu{k}", "cpu") for k in range(int(text))]


def slot_names(machine: str, slots: list[tuple[str, str]]) -> list[str]:
    """Names of ``machine``'s device slots (global concurrency limits of one slot each)."""
    return [f"{SLOT_PREFIX}{machine}-{slot}" for slot, _ in slots]


def task_device(config: RunConfig) -> str:
    """The device a task computes on: its slot's device when it holds one and the config leaves the choice open.

    ``auto`` and ``cuda`` follow the slot (``cuda:1`` on a worker's second GPU); ``cpu`` and ``cuda:N`` are the
    user's explicit choice and win. Outside a slot: ``config.resolved_device()``.
    """
    pinned = _PINNED.get()
    if pinned is None and (pending := _PENDING.get()) is not None:
        pinned = pending.take()  # the task's first ask: its slot is taken now, and held until it returns
    if pinned is not None and config.device.strip().lower() in ("auto", "cuda"):
        return pinned
    return config.resolved_device()


class _SlotOnDemand:
    """A ``gpu`` task's slot, taken at its first :func:`task_device` and released when the task returns."""

    def __init__(self, stack: contextlib.ExitStack) -> None:
        self.stack, self.taken, self.device = stack, False, None

    def take(self) -> str | None:
        """The slot's device, the slot taken on the first call (None: no machine named, nothing to take)."""
        if not self.taken:
            self.taken = True
            self.device = self.stack.enter_context(device_slot())
        return self.device


def on_device_slot(fn: Callable) -> Callable:
    """``fn`` run with one device slot of this worker (:func:`device_slot`) from its first ask for a device on.

    A run that returns a stored result without asking (the store lookup comes first) never waits for a slot, so a
    re-run's reused stages do not queue behind the machine's busy GPU.
    """

    @functools.wraps(fn)
    def holding_a_slot(*args: Any, **kwargs: Any) -> Any:
        with contextlib.ExitStack() as stack:
            token = _PENDING.set(_SlotOnDemand(stack))
            try:
                return fn(*args, **kwargs)
            finally:
                _PENDING.reset(token)

    return holding_a_slot


@contextlib.contextmanager
def device_slot(machine: str | None = None) -> Iterator[str | None]:
    """Hold one free device slot of ``machine`` (default ``$SYMFUSE_DEVICE_SLOTS``) for the block; yield its device.

    Yields None, acquiring nothing, when no machine is named or no Prefect API is configured.
    """
    from prefect.settings import PREFECT_API_URL

    machine = machine if machine is not None else os.environ.get(MACHINE_ENV, "").strip()
    if not machine or not PREFECT_API_URL.value():
        yield None
        return
    slots = slot_devices()
    names = slot_names(machine, slots)
    name, lease_id, device = _take_one(names, [device for _, device in slots])
    renewer = _Renewer(lease_id, name)
    token = _PINNED.set(device)
    _logger().info("holding device slot %s: computing on %s", name, device)
    try:
        yield device
    finally:
        _PINNED.reset(token)
        renewer.stop_and_release()


def _take_one(names: list[str], devices: list[str]) -> tuple[str, UUID, str]:
    """The first free slot of ``names`` (created if missing), waiting while every one is busy."""
    import httpx
    from prefect.client.orchestration import get_client

    said = False
    with get_client(sync_client=True) as client:
        for name in names:
            ensure_limit(client, name)
        while True:
            for name, device in zip(names, devices, strict=True):
                try:
                    response = client.increment_concurrency_slots_with_lease(
                        names=[name], slots=1, mode="concurrency", lease_duration=LEASE_SECONDS
                    )
                    return name, UUID(response.json()["lease_id"]), device
                except httpx.HTTPStatusError as exc:
                    if exc.response.status_code != 423:  # 423 Locked: the slot is busy
                        raise
            if not said:
                _logger().info("every device slot of this machine (%s) is busy; waiting for one", ", ".join(names))
                said = True
            time.sleep(POLL_SECONDS)


def ensure_limit(client: Any, name: str) -> None:
    """Create the one-slot global concurrency limit ``name`` unless it exists.

    Two processes may create it at once: the loser's create fails (409, or a 500 from the server's unique
    constraint on sqlite), and the limit then exists; only a limit still missing after that is an error.
    """
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectNotFound

    try:
        client.read_global_concurrency_limit_by_name(name)
        return
    except ObjectNotFound:
        pass
    try:
        client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
    except Exception:
        client.read_global_concurrency_limit_by_name(name)  # created by the other process, else this raises


class _Renewer:
    """Renews a device slot's lease from a daemon thread until released (a renewal error is only logged)."""

    def __init__(self, lease_id: UUID, name: str) -> None:
        self.lease_id, self.name = lease_id, name
        self._stop = threading.Event()
        context = contextvars.copy_context()  # the caller's Prefect settings (API URL)
        self._thread = threading.Thread(target=context.run, args=(self._loop,), daemon=True, name=name)
        self._thread.start()

    def _loop(self) -> None:
        from prefect.client.orchestration import get_client

        while not self._stop.wait(RENEW_EVERY_SECONDS):
            try:
                with get_client(sync_client=True) as client:
                    client.renew_concurrency_lease(self.lease_id, lease_duration=LEASE_SECONDS)
            except Exception as exc:  # the task goes on; at worst another task shares the device for a while
                log.warning("device slot %s: lease renewal failed (%s)", self.name, type(exc).__name__)

    def stop_and_release(self) -> None:
        from prefect.client.orchestration import get_client

        self._stop.set()
        self._thread.join(timeout=30)
        try:
            with get_client(sync_client=True) as client:
                client.release_concurrency_slots_with_lease(self.lease_id)
        except Exception as exc:  # the lease expires on its own
            log.warning("device slot %s: release failed (%s); freed when its lease expires", self.name, exc)


def _logger() -> logging.Logger | logging.LoggerAdapter:
    """The run logger inside a run, else this module's logger."""
    from prefect.exceptions import MissingContextError
    from prefect.logging import get_run_logger

    try:
        return get_run_logger()
    except MissingContextError:
        return log
