"""RegMean++: one layer is RegMean; two linear layers follow the closed form on the merged first layer's outputs."""

import pytest
import torch

from symfuse.merge.regmean import regmean_solve
from symfuse.merge.regmean_plusplus import regmean_plusplus


def _data(g, k, n, d):
    return [torch.randn(n + 7 * i, d, generator=g, dtype=torch.float64) for i in range(k)]


def test_one_layer_equals_regmean():
    g = torch.Generator().manual_seed(0)
    xs = _data(g, 3, 40, 6)
    layer = [{"w": torch.randn(4, 6, generator=g, dtype=torch.float64), "b": torch.randn(4, generator=g)} for _ in xs]
    grams = [x.T @ x for x in xs]
    calls = []

    def collect(i, merged):
        calls.append((i, len(merged)))
        return [{"w": gm} for gm in grams]

    mw = [1.0, 2.0, 3.0]
    out = regmean_plusplus([layer], collect, mw, alpha=0.9)
    want, _ = regmean_solve([m["w"] for m in layer], grams, mw, 0.9)
    torch.testing.assert_close(out[0]["w"], want, rtol=0, atol=1e-12)
    torch.testing.assert_close(out[0]["b"], sum(c * m["b"] for c, m in zip(mw, layer, strict=True)) / 6)
    assert calls == [(0, 0)]


def test_two_linear_layers_follow_the_closed_form():
    # y = W2 W1 x per model; layer 2's Grams come from the MERGED layer 1's outputs on each model's data
    g = torch.Generator().manual_seed(1)
    xs = _data(g, 2, 30, 5)
    w1 = [torch.randn(4, 5, generator=g, dtype=torch.float64) for _ in xs]
    w2 = [torch.randn(3, 4, generator=g, dtype=torch.float64) for _ in xs]
    layers = [[{"w": w} for w in w1], [{"w": w} for w in w2]]
    seen = []

    def collect(i, merged):
        seen.append([m["w"].clone() for m in merged])
        grams = []
        for x in xs:
            h = x
            for m in merged:  # the merged prefix
                h = h @ m["w"].T
            grams.append({"w": h.T @ h})
        return grams

    out = regmean_plusplus(layers, collect, alpha=1.0)
    # by hand: W = (sum_i W_i G_i) (sum_i G_i)^-1
    ga = [x.T @ x for x in xs]
    m1 = (w1[0] @ ga[0] + w1[1] @ ga[1]) @ torch.linalg.inv(ga[0] + ga[1])
    hs = [x @ m1.T for x in xs]
    gb = [h.T @ h for h in hs]
    m2 = (w2[0] @ gb[0] + w2[1] @ gb[1]) @ torch.linalg.inv(gb[0] + gb[1])
    torch.testing.assert_close(out[0]["w"], m1, rtol=0, atol=1e-10)
    torch.testing.assert_close(out[1]["w"], m2, rtol=0, atol=1e-10)
    assert len(seen) == 2 and seen[0] == [] and torch.equal(seen[1][0], out[0]["w"])
    # it is the least-squares fit of the candidates' layer 2 on the merged layer 1's features ...
    resid = sum(((h @ out[1]["w"].T - h @ w.T) ** 2).sum() for h, w in zip(hs, w2, strict=True))
    for _ in range(20):
        other = out[1]["w"] + 1e-3 * torch.randn(3, 4, generator=g, dtype=torch.float64)
        assert resid < sum(((h @ other.T - h @ w.T) ** 2).sum() for h, w in zip(hs, w2, strict=True))
    # ... and not RegMean, whose layer-2 Grams come from each candidate's own layer 1
    gr = [(x @ w.T).T @ (x @ w.T) for x, w in zip(xs, w1, strict=True)]
    plain, _ = regmean_solve(w2, gr, alpha=1.0)
    assert float((plain - out[1]["w"]).norm()) > 1e-3 * float(plain.norm())


def test_bad_collect_is_rejected():
    g = torch.Generator().manual_seed(2)
    layer = [{"w": torch.randn(2, 3, generator=g)} for _ in range(2)]
    with pytest.raises(ValueError, match="collect returned 1 Gram sets for layer 0, expected 2"):
        regmean_plusplus([layer], lambda i, m: [{"w": torch.eye(3)}])
    with pytest.raises(ValueError, match=r"Grams for unknown tensors \['v'\]"):
        regmean_plusplus([layer], lambda i, m: [{"v": torch.eye(3)}] * 2)
