"""Where the maths runs: one resolver for every ``device`` argument (commands, configs, tasks, library calls).

``auto`` is CUDA when torch sees a GPU, else the CPU. A device that is asked for by name and is not there is an
error (:class:`symfuse.errors.DeviceError`, one line naming the option), never a silent CPU run. Apple's ``mps``
is refused: the closed forms (SVDs, Cholesky, assignment costs) need float64, which it lacks.
"""

from __future__ import annotations

import re

import torch

from symfuse.errors import DeviceError

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"
_PATTERN = re.compile(r"(auto|cpu|cuda)(:(\d+))?")


def _cuda_missing() -> str:
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is a CPU build"
    return "torch sees no GPU (check the driver and CUDA_VISIBLE_DEVICES)"


def resolve_device(device: str | torch.device | None = "auto", option: str = "device") -> torch.device:
    """The torch device ``device`` names, checked to be there.

    Args:
        device: ``auto`` (or None), ``cpu``, ``cuda``, ``cuda:N``, or a :class:`torch.device`.
        option: How the caller names the setting in errors (``--device``, ``device`` of a run config).

    Returns:
        ``cpu`` or ``cuda:N`` (``cuda`` becomes the current CUDA device's index).

    Raises:
        DeviceError: the name is not a device, or the device is not on this machine.
    """
    if isinstance(device, torch.device):
        device = str(device)
    text = "auto" if device is None else str(device).strip().lower()
    m = _PATTERN.fullmatch(text)
    if m is None or (m.group(1) != "cuda" and m.group(2)):
        raise DeviceError(f"{option}: {device!r} is not a device symfuse runs on — give {DEVICE_CHOICES}")
    kind, index = m.group(1), m.group(3)
    if kind == "cpu" or (kind == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DeviceError(f"{option}: {device!r} asked for, but {_cuda_missing()} — use cpu (or auto) instead")
    count = torch.cuda.device_count()
    i = int(index) if index is not None else torch.cuda.current_device()
    if i >= count:
        raise DeviceError(
            f"{option}: {device!r} asked for, but this machine has {count} CUDA device(s) (cuda:0..cuda:{count - 1})"
            " — pick one of them or use auto"
        )
    return torch.device("cuda", i)


def device_name(device: torch.device) -> str:
    """A human-readable name for reports: ``cpu`` or ``cuda:0 (NVIDIA H100 80GB HBM3)``."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (timings); nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
