"""The plain-torch RegMean (the device path) against the closed form and against the fused CPU path."""

import pytest
import torch

from symfuse.merge import RegMeanMerger, TensorInputs, regmean_solve
from symfuse.merge.regmean_plain import regmean_plain
from tests.symfuse.merge.test_regmean import _regression_models


def test_plain_regmean_is_least_squares_on_concatenated_data():
    xs, ys, ws, grams, ns = _regression_models()
    expected = torch.linalg.lstsq(torch.cat(xs), torch.cat(ys)).solution.T
    torch.testing.assert_close(regmean_plain(ws, grams, ns, alpha=1.0), expected, rtol=0, atol=1e-8)
    out_t = regmean_plain([w.T for w in ws], grams, ns, alpha=1.0, conv1d=True)
    torch.testing.assert_close(out_t, expected.T, rtol=0, atol=1e-8)


@pytest.mark.parametrize("alpha", [0.0, 0.5, 0.9])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_plain_regmean_equals_the_fused_path(alpha, dtype):
    _, _, ws, grams, ns = _regression_models(k=4, d_in=9, d_out=5, seed=3)
    ws32 = [w.float() for w in ws]
    fused, _ = regmean_solve(ws32, grams, model_weights=ns, alpha=alpha, dtype=dtype)
    plain = regmean_plain(ws32, grams, ns, alpha=alpha, dtype=dtype)
    assert plain.dtype == torch.float32
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(plain, fused, rtol=tol, atol=tol)


def test_identical_grams_give_the_weighted_mean_and_singular_sums_fall_back_to_lstsq():
    _, _, ws, grams, ns = _regression_models(k=3)
    same = [grams[0]] * 3
    mean = sum(n * w for n, w in zip(ns, ws, strict=True)) / sum(ns)
    torch.testing.assert_close(regmean_plain(ws, same, ns, alpha=0.7), mean, rtol=0, atol=1e-12)
    x = torch.randn(2, 6, dtype=torch.float64)  # rank 2 < 6: no Cholesky factor
    low = [x.T @ x, 2 * x.T @ x]
    fused, system = regmean_solve(ws[:2], low, alpha=1.0)
    assert system.factor is None
    torch.testing.assert_close(regmean_plain(ws[:2], low, alpha=1.0), fused, rtol=1e-6, atol=1e-8)


def test_merger_off_the_cpu_path_reuses_one_factor_per_input():
    """The merger's device branch (driven on the CPU here) equals its fused branch and reuses q/k/v's factor."""
    _, _, ws, grams, _ = _regression_models(k=3, d_in=7, d_out=7)
    fused = RegMeanMerger(alpha=0.9)
    plain = RegMeanMerger(alpha=0.9)
    w = fused.model_weights(3)
    outs = []
    for role in ("q", "k", "v"):
        t = TensorInputs(f"{role}.weight", [x + i for i, x in enumerate(ws)], w, gram=grams, gram_key="layer0.in")
        outs.append((fused.merge_tensor(t), plain._merge_plain(t)))
    for a, b in outs:
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-10)
    assert plain.counters == {"regmean_solves": 3, "factor_reused": 2}
