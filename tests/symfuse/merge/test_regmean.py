"""RegMean closed forms: least squares on concatenated data; identical Grams give the plain average."""

import pytest
import torch

from symfuse.merge import RegMeanMerger, TensorInputs, regmean_solve
from symfuse.merge.regmean import BF16_UNIT


def _regression_models(k=3, d_in=6, d_out=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    w_true = torch.randn(d_out, d_in, generator=g, dtype=torch.float64)
    xs, ys, ws, grams, ns = [], [], [], [], []
    for i in range(k):
        n = 20 + 7 * i  # different amounts of data
        x = torch.randn(n, d_in, generator=g, dtype=torch.float64) * (1 + i) + i  # different input distributions
        y = x @ w_true.T + 0.3 * torch.randn(n, d_out, generator=g, dtype=torch.float64)
        w = torch.linalg.lstsq(x, y).solution.T  # (out, in): this model's own least-squares fit
        xs.append(x)
        ys.append(y)
        ws.append(w)
        grams.append(x.T @ x / n)  # the stored statistic: mean Gram
        ns.append(float(n))
    return xs, ys, ws, grams, ns


def test_regmean_equals_least_squares_on_concatenated_data():
    xs, ys, ws, grams, ns = _regression_models()
    merged, _ = regmean_solve(ws, grams, model_weights=ns, alpha=1.0)
    expected = torch.linalg.lstsq(torch.cat(xs), torch.cat(ys)).solution.T
    torch.testing.assert_close(merged, expected, rtol=0, atol=1e-8)
    # Conv1D layout (in, out): same solution, transposed storage.
    merged_t, _ = regmean_solve([w.T for w in ws], grams, model_weights=ns, alpha=1.0, conv1d=True)
    torch.testing.assert_close(merged_t, expected.T, rtol=0, atol=1e-8)
    # The merger object with per-model weights n_i gives the same (through normalised weights).
    m = RegMeanMerger(alpha=1.0, weights=ns)
    out = m.merge_tensor(TensorInputs("lin.weight", ws, m.model_weights(3), gram=grams))
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-8)


def test_regmean_identical_grams_is_simple_average():
    _, _, ws, grams, _ = _regression_models()
    shared = [grams[0]] * 3
    merged, _ = regmean_solve(ws, shared, alpha=0.9)
    torch.testing.assert_close(merged, torch.stack(ws).mean(0), rtol=0, atol=1e-10)


def test_regmean_alpha_scales_off_diagonals_only():
    _, _, ws, grams, _ = _regression_models(k=2)
    alpha = 0.4
    scaled = [alpha * g + (1 - alpha) * torch.diag(torch.diag(g)) for g in grams]
    a = sum(scaled)
    b = sum(s @ w.T for s, w in zip(scaled, ws))
    expected = torch.linalg.solve(a, b).T
    merged, _ = regmean_solve(ws, grams, alpha=alpha)
    torch.testing.assert_close(merged, expected, rtol=0, atol=1e-10)
    # alpha = 0: diagonal Grams -> per-input-feature weighted average
    merged0, _ = regmean_solve(ws, grams, alpha=0.0)
    d = [torch.diag(g) for g in grams]
    torch.testing.assert_close(merged0, (d[0] * ws[0] + d[1] * ws[1]) / (d[0] + d[1]), rtol=0, atol=1e-10)


def test_regmean_singular_gram_falls_back_to_lstsq(caplog):
    x = torch.randn(3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    x[:, 2] = 0  # an input never active: a zero row and column, so the Gram is exactly singular (not by rounding)
    g = x.T @ x / 3
    w = torch.randn(2, 5, dtype=torch.float64)
    m = RegMeanMerger(alpha=1.0)
    out = m.merge_tensor(TensorInputs("lin.weight", [w, w], [0.5, 0.5], gram=[g, g]))
    assert m.counters.get("lstsq_fallback") == 1 and "lstsq" in caplog.text
    # lstsq picks a solution of G X = G W^T: the merged layer reproduces W on the data's span
    torch.testing.assert_close(x @ out.T, x @ w.T, rtol=0, atol=1e-8)


def test_regmean_float32_error_is_small():
    _, _, ws, grams, ns = _regression_models(k=5, d_in=64, d_out=32)
    hi, _ = regmean_solve(ws, grams, ns, alpha=0.9)
    lo, _ = regmean_solve([w.float() for w in ws], [g.float() for g in grams], ns, alpha=0.9, dtype=torch.float32)
    assert lo.dtype == torch.float32
    assert (lo.double() - hi).abs().max() / hi.abs().max() < 1e-4


def test_regmean_rejects_bad_alpha_and_shapes():
    _, _, ws, grams, _ = _regression_models(k=2)
    with pytest.raises(ValueError, match="alpha"):
        regmean_solve(ws, grams, alpha=1.5)
    with pytest.raises(ValueError, match="does not match Gram"):
        regmean_solve([w.T for w in ws], grams)


def _direct(ws, grams, cs, alpha):
    """The textbook formula: (sum c_i G_i')^-1 sum c_i G_i' W_i^T, in float64."""
    scaled = [alpha * g + (1 - alpha) * torch.diag(torch.diag(g)) for g in grams]
    a = sum(c * s for c, s in zip(cs, scaled))
    b = sum(c * s @ w.T for c, s, w in zip(cs, scaled, ws))
    return torch.linalg.solve(a, b).T


def test_delta_form_equals_direct_formula_in_float64():
    _, _, ws, grams, ns = _regression_models(k=4, d_in=7, d_out=5)
    for cs in (ns, [0.0, 2.0, 1.0, 3.0]):  # a zero weight: the reference model is the largest weight's
        merged, system = regmean_solve(ws, grams, model_weights=cs, alpha=0.7)
        assert system.ref == max(range(4), key=cs.__getitem__)
        torch.testing.assert_close(merged, _direct(ws, grams, cs, 0.7), rtol=0, atol=1e-10)
        merged_t, _ = regmean_solve([w.T for w in ws], grams, model_weights=cs, alpha=0.7, conv1d=True)
        torch.testing.assert_close(merged_t, _direct(ws, grams, cs, 0.7).T, rtol=0, atol=1e-10)


def _fine_tunes(k, d_in, d_out, delta, seed=0):
    """K fine-tunes of one base (base + delta * |W| noise) and well-conditioned, different Grams."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(d_out, d_in, generator=g, dtype=torch.float64)
    ws = [base + delta * torch.randn(d_out, d_in, generator=g, dtype=torch.float64) for _ in range(k)]
    grams = []
    for _ in range(k):
        x = torch.randn(4 * d_in, d_in, generator=g, dtype=torch.float64)
        grams.append(x.T @ x / (4 * d_in))
    return ws, grams


def test_bfloat16_products_error_bound_on_fine_tunes():
    ws, grams = _fine_tunes(k=5, d_in=96, d_out=48, delta=1e-3)
    exact, _ = regmean_solve(ws, grams)
    ws32, g32 = [w.float() for w in ws], [x.float() for x in grams]
    lo, system = regmean_solve(ws32, g32, dtype=torch.float32, delta_dtype="bfloat16")
    assert lo.dtype == torch.float32
    err = float((lo.double() - exact).abs().max() / exact.abs().max())
    ratio = max(float((w - torch.stack(ws).mean(0)).norm()) for w in ws) / float(torch.stack(ws).mean(0).norm())
    assert err <= BF16_UNIT * ratio * system.cond  # the bound the auto rule uses
    assert err < 3e-6  # bfloat16 rounding of deltas of 1e-3 (measured 7e-7; float32 products: 1e-7)
    lo_t, _ = regmean_solve([w.T for w in ws32], g32, dtype=torch.float32, conv1d=True, delta_dtype="bfloat16")
    assert float((lo_t.double() - exact.T).abs().max() / exact.abs().max()) < 3e-6  # Conv1D layout, same bound
    # The same products in bfloat16 without the delta form (whole weights) would be ~1000x worse: the delta
    # form is what makes bfloat16 usable at all.
    naive = sum(g.bfloat16().float() @ w.T.bfloat16().float() for g, w in zip(g32, ws32))
    naive = torch.linalg.solve(sum(g32), naive).T
    assert float((naive.double() - exact).abs().max() / exact.abs().max()) > 20 * err


def test_auto_products_use_bfloat16_only_for_small_deltas_and_good_conditioning():
    merger = RegMeanMerger(alpha=0.9, dtype="float32", delta_dtype="auto", bf16_tol=1e-4)
    w5 = merger.model_weights(5)
    tiny, grams = _fine_tunes(k=5, d_in=64, d_out=32, delta=1e-5)
    indep, _ = _fine_tunes(k=5, d_in=64, d_out=32, delta=10.0)
    g32 = [g.float() for g in grams]
    out = merger.merge_tensor(TensorInputs("a.weight", [w.float() for w in tiny], w5, gram=g32))
    assert merger.counters == {"regmean_solves": 1, "products_bfloat16": 1}
    exact, _ = regmean_solve(tiny, grams, alpha=0.9)
    assert float((out.double() - exact).abs().max() / exact.abs().max()) < 1e-4
    merger.merge_tensor(TensorInputs("b.weight", [w.float() for w in indep], w5, gram=g32))
    assert merger.counters.get("products_float32") == 1  # independent models: float32 products


def test_layers_reading_one_input_share_one_factor():
    _, _, ws, grams, _ = _regression_models(k=3, d_in=6, d_out=4)
    merger = RegMeanMerger(alpha=0.5)
    w3 = merger.model_weights(3)
    first = merger.merge_tensor(TensorInputs("q.weight", ws, w3, gram=grams, gram_key="q"))
    others = [w + 1 for w in ws]
    # same key: the Grams are not even read again (a wrong Gram here would change nothing)
    second = merger.merge_tensor(TensorInputs("k.weight", others, w3, gram=[g * 0 for g in grams], gram_key="q"))
    assert merger.counters["factor_reused"] == 1
    torch.testing.assert_close(first, _direct(ws, grams, w3, 0.5), rtol=0, atol=1e-10)
    torch.testing.assert_close(second, _direct(others, grams, w3, 0.5), rtol=0, atol=1e-10)
    third = merger.merge_tensor(TensorInputs("v.weight", ws, w3, gram=[g * 2 for g in grams], gram_key="v"))
    torch.testing.assert_close(third, first, rtol=0, atol=1e-10)  # scaling every Gram by 2 changes nothing
    assert merger.counters["factor_reused"] == 1
