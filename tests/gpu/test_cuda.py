"""On a CUDA machine: the device paths equal the CPU paths (``pytest -m gpu``; bench/gpu_check.py runs them)."""

import sys
from pathlib import Path

import pytest
import torch

from symfuse.merge.regmean import regmean_solve
from symfuse.merge.regmean_plain import regmean_plain

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

pytestmark = pytest.mark.gpu


def test_regmean_on_cuda_equals_the_fused_cpu_path():
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(64, 96, generator=g) for _ in range(3)]
    xs = [torch.randn(200, 96, generator=g, dtype=torch.float64) for _ in range(3)]
    grams = [x.T @ x / 200 for x in xs]
    want, _ = regmean_solve(ws, grams, alpha=0.9)
    got = regmean_plain([w.cuda() for w in ws], [gr.cuda() for gr in grams], alpha=0.9)
    assert got.device.type == "cuda"
    torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-7)


def test_match_on_cuda_equals_cpu(tmp_path):
    import gpu_parity

    rows = gpu_parity.match_parity(tmp_path, "cpu", "cuda", families=("llama",))
    assert all(r["ok"] for r in rows), rows


def test_a_missing_cuda_index_is_refused_before_any_work(tmp_path):
    from symfuse.errors import DeviceError
    from symfuse.merge import merge_checkpoints

    with pytest.raises(DeviceError, match="CUDA device"):
        merge_checkpoints("simple", [tmp_path / "a", tmp_path / "b"], tmp_path / "out", device="cuda:99")
    assert not (tmp_path / "out").exists()
