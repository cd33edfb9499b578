"""RegMean's output finiteness, summed in its last pass: known finite only when it is, and the merge's own check."""

import json

import pytest
import torch
from safetensors.torch import load_file

import symfuse.merge.checkpoints as mc
import symfuse.merge.tensor_merge as tm
from symfuse.checkpoint import load_hf_model
from symfuse.merge import merge_checkpoints
from symfuse.merge.gram_systems import build_system
from symfuse.merge.regmean import regmean_apply, regmean_solve
from symfuse.stats import linear_modules, save_stats
from tests.tiny import save_tiny


def _spd(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3 * n, n, generator=g, dtype=torch.float64)
    return x.T @ x / (3 * n) + 0.1 * torch.eye(n, dtype=torch.float64)


def _weights(k, shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(k)]


@pytest.mark.parametrize("conv1d", [False, True])
@pytest.mark.parametrize(("stored", "dtype"), [(torch.float32, torch.float32), (torch.float16, torch.float64)])
def test_finite_output_is_reported_and_equals_the_plain_solve(conv1d, stored, dtype):
    n, m = 300, 450  # 135,000 elements: two chunks of the last pass
    grams = [_spd(n, s) for s in range(3)]
    ws = _weights(3, (n, m) if conv1d else (m, n), stored)
    system = build_system(grams, alpha=0.9, dtype=dtype)
    finite: list[bool] = []
    got, _ = regmean_apply(system, ws, conv1d, finite=finite)
    assert finite == [True] and got.dtype == stored
    want, _ = regmean_solve(ws, grams, alpha=0.9, conv1d=conv1d, dtype=torch.float64)
    tol = 1e-3 if stored == torch.float16 else 1e-4
    torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol)


def test_overflow_into_the_stored_dtype_is_not_reported_finite():
    """float16 weights near the top of their range: the solution is finite in float32, not once stored."""
    n, m = 64, 5
    g = torch.Generator().manual_seed(0)
    grams = []
    for s in range(2):  # few samples: strongly correlated inputs, a solution beyond the weights' own range
        x = torch.randn(n, n, generator=torch.Generator().manual_seed(s), dtype=torch.float64)
        grams.append(x.T @ x / n + 1e-3 * torch.eye(n, dtype=torch.float64))
    ws = [((torch.rand(m, n, generator=g) * 2 - 1) * 60_000).half() for _ in range(2)]
    assert all(bool(torch.isfinite(w).all()) for w in ws)
    system = build_system(grams, alpha=0.9, dtype=torch.float32)
    finite: list[bool] = []
    out, _ = regmean_apply(system, ws, finite=finite)
    assert out.dtype == torch.float16 and not bool(torch.isfinite(out).all()) and finite == []
    wide, _ = regmean_apply(system, [w.float() for w in ws], finite=(finite32 := []))
    assert finite32 == [True] and float(wide.abs().max()) > 65_504  # finite before the cast
    nan = [w.float() for w in ws]
    nan[1][0, 0] = float("nan")
    finite = []
    regmean_apply(system, nan, finite=finite)
    assert finite == []


def test_merge_spares_its_own_check_for_regmean_outputs(tmp_path, monkeypatch):
    """RegMean's solved weights are checked in their last pass; everything else still by the merge."""
    models = [save_tiny(tmp_path / f"m{i}", "bert", seed=i) for i in range(2)]
    stats = []
    for i, folder in enumerate(models):
        net = load_hf_model(folder)
        grams = {name: _spd(mod.in_features, 10 * i + j) for j, (name, mod) in enumerate(linear_modules(net).items())}
        stats.append(save_stats(grams, tmp_path / f"s{i}" / "gram.safetensors", {"kind": "gram"}))
    checked: list[int] = []
    real = tm._all_finite

    def counting(t):
        checked.append(t.numel())
        return real(t)

    monkeypatch.setattr(tm, "_all_finite", counting)
    monkeypatch.setattr(mc, "check_stats_belong", lambda *a: None)  # hand-made statistics carry no fingerprint
    out = merge_checkpoints("regmean", models, tmp_path / "out", stats=stats, dtype="float32")
    n_linear = len(linear_modules(load_hf_model(models[0])))
    assert json.loads((out / "symfuse_report.json").read_text())["counters"]["regmean_solves"] == n_linear
    merged = load_file(str(out / "model.safetensors"))
    floats = [t for n, t in merged.items() if t.is_floating_point()]
    assert len(checked) == len(floats) - n_linear  # biases, norms, embeddings: the merge's check
    assert all(bool(torch.isfinite(t).all()) for t in floats)


def test_finite_output_whose_float32_sum_overflows_is_never_refused():
    """Weights near 1e36: the output is finite though its chunks' float32 sums overflow. Whatever the last pass
    reports, the merge's own test (``output_finite`` or the element-wise check) accepts it: no false NaN / inf."""
    n, m = 300, 450
    grams = [_spd(n, s) for s in range(2)]
    ws = [(w.abs() + 1) * 1e36 for w in _weights(2, (m, n), torch.float32)]
    assert not torch.isfinite(ws[0].sum())
    system = build_system(grams, alpha=0.9, dtype=torch.float32)
    finite: list[bool] = []
    out, _ = regmean_apply(system, ws, finite=finite)
    assert bool(torch.isfinite(out).all()) and finite in ([], [True])
    assert finite == [True] or tm._all_finite(out)
