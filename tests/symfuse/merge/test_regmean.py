"""RegMean closed forms: least squares on concatenated data; identical Grams give the plain average."""

import pytest
import torch

from symfuse.merge import RegMeanMerger, TensorInputs, regmean_solve


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
    x = torch.randn(3, 5, dtype=torch.float64)  # rank 3 < 5: singular Gram
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
