"""The one device resolver: auto, explicit devices, and a device that is not there (an error, never a CPU run)."""

import pytest
import torch

from symfuse.device import resolve_device
from symfuse.errors import DeviceError, UsageError


def test_cpu_and_auto_without_a_gpu():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(" CPU ") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")
        assert resolve_device(None) == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("name", ["cuda", "cuda:0", "cuda:9"])
def test_a_missing_gpu_is_an_error_naming_the_option(name):
    with pytest.raises(DeviceError, match=rf"^--device: '{name}' asked for, but .* use cpu \(or auto\) instead"):
        resolve_device(name, "--device")


@pytest.mark.parametrize("name", ["gpu", "cpu:1", "mps", "cuda:x", "auto:0", ""])
def test_names_that_are_not_devices(name):
    with pytest.raises(UsageError, match="is not a device symfuse runs on — give auto, cpu, cuda or cuda:N"):
        resolve_device(name)


@pytest.mark.gpu
def test_cuda_indices_on_a_gpu_machine():
    n = torch.cuda.device_count()
    assert resolve_device("auto").type == "cuda"
    assert resolve_device(f"cuda:{n - 1}") == torch.device("cuda", n - 1)
    with pytest.raises(DeviceError, match=f"has {n} CUDA device"):
        resolve_device(f"cuda:{n}")
