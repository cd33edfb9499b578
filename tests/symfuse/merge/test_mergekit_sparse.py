"""mergekit's sparsifying strategies: breadcrumbs(-ties), della(-linear), sce — closed forms, refusals, the CLI."""

import pytest
import torch
from safetensors.torch import load_file

from symfuse.errors import MissingStats
from symfuse.merge import MERGERS, TensorInputs, merge_checkpoints, merger_params
from symfuse.merge.breadcrumbs import breadcrumbs_prune, outlier_band
from symfuse.merge.della import magprune, magprune_probs
from symfuse.merge.sce import sce_combine, sce_select, sce_weights
from symfuse.merge.task_vectors import dare_drop, gta_combine, rescale_l1, seeded_uniform, trim_top
from tests.cli.helpers import run_cli
from tests.tiny import save_tiny_text_classifier

F64 = torch.float64


def _inputs(taus, base=None, weights=None, name="w"):
    base = torch.zeros_like(taus[0]) if base is None else base
    k = len(taus)
    return TensorInputs(name, [base + t for t in taus], weights or [1 / k] * k, base=base)


# ------------------------------------------------------------------------------------------ breadcrumbs


def test_breadcrumbs_keeps_exactly_the_middle_band_by_magnitude():
    tau = torch.tensor([0.1, -0.9, 0.3, -0.5, 0.7, -0.2, 0.8, 0.4, -0.6, 1.0], dtype=F64)
    # |tau| ascending: 0.1 0.2 0.3 0.4 0.5 0.6 0.7 0.8 0.9 1.0; gamma 0.2 drops 0.9, 1.0; density 0.5 keeps 0.4..0.8
    band = outlier_band(tau, density=0.5, gamma=0.2)
    assert torch.equal(band, (tau.abs() >= 0.35) & (tau.abs() <= 0.85))
    out = breadcrumbs_prune(tau, 0.5, 0.2)
    assert torch.equal(out, torch.where(band, tau, torch.zeros_like(tau)))
    assert torch.equal(breadcrumbs_prune(tau, 1.0, 0.2), tau)  # density 1: the whole task vector, gamma unused
    # density + gamma > 1 never happens through the params; the band still holds int(density n) entries
    assert int(outlier_band(tau, 0.9, 0.0).sum()) == 9


def test_breadcrumbs_with_gamma_0_is_ties_style_top_k_magnitude():
    torch.manual_seed(0)
    tau = torch.randn(6, 10, dtype=F64)
    for density in (0.1, 0.25, 0.5, 0.9):
        assert torch.equal(breadcrumbs_prune(tau, density, 0.0), trim_top(tau, density))


def test_breadcrumbs_rescale_keeps_the_l1_norm():
    torch.manual_seed(1)
    tau = torch.randn(200, dtype=F64)
    out = breadcrumbs_prune(tau, 0.5, 0.1, rescale=True)
    torch.testing.assert_close(out.abs().sum(), tau.abs().sum())
    assert torch.equal(out != 0, outlier_band(tau, 0.5, 0.1))
    zero = torch.zeros(5, dtype=F64)
    assert torch.equal(rescale_l1(zero, zero == 0), zero)  # a zero task vector stays zero (no 0 / 0)


def test_breadcrumbs_mergers_are_task_arithmetic_and_ties_of_the_pruned_vectors():
    torch.manual_seed(2)
    base = torch.randn(8, 5, dtype=F64)
    taus = [torch.randn(8, 5, dtype=F64) for _ in range(3)]
    w = [0.2, 0.3, 0.5]
    pruned = [breadcrumbs_prune(t, 0.6, 0.1) for t in taus]
    got = MERGERS["breadcrumbs"](density=0.6, gamma=0.1, **{"lambda": 0.5}).merge_tensor(_inputs(taus, base, w))
    torch.testing.assert_close(got, base + 0.5 * sum(3 * wi * p for wi, p in zip(w, pruned, strict=True)))
    got = MERGERS["breadcrumbs-ties"](density=0.6, gamma=0.1).merge_tensor(_inputs(taus, base, w))
    stacked = torch.stack([3 * wi * p for wi, p in zip(w, pruned, strict=True)])
    sign = torch.where(stacked.sum(0) >= 0, 1.0, -1.0).to(F64)
    torch.testing.assert_close(got, base + torch.where(torch.sign(stacked) == sign, stacked, 0.0).sum(0))
    # normalized, breadcrumbs-ties with gamma 0 is TIES (the same top-k trim, elected signs, disjoint mean)
    ties = MERGERS["ties"](density=0.4).merge_tensor(_inputs(taus, base, w))
    bt = MERGERS["breadcrumbs-ties"](density=0.4, gamma=0.0, normalize=True).merge_tensor(_inputs(taus, base, w))
    torch.testing.assert_close(bt, ties)


def test_gta_combine_normalises_by_the_weights_that_entered():
    a = torch.tensor([1.0, -2.0, 3.0], dtype=F64)
    b = torch.tensor([-1.0, -1.0, 1.0], dtype=F64)
    # weighted by 1 and 3: sums [-2, -5, 6] -> majority signs [-, -, +]; entry 0: only b (3 * -1) with weight 3
    out = gta_combine([a, b], [1.0, 3.0], consensus=True, normalize=True)
    torch.testing.assert_close(out, torch.tensor([-1.0, -5.0 / 4, 6.0 / 4], dtype=F64))
    out = gta_combine([a, b], [1.0, 3.0], consensus=False, normalize=True)
    torch.testing.assert_close(out, (a + 3 * b) / 4)


# ------------------------------------------------------------------------------------------ della


def test_magprune_probabilities_span_density_plus_minus_epsilon_by_rank():
    tau = torch.tensor([[0.3, -0.1, 0.5, 0.2, -0.4], [1.0, 2.0, -3.0, 4.0, 5.0]], dtype=F64)
    p = magprune_probs(tau, 0.5, 0.2)
    torch.testing.assert_close(p[0], torch.tensor([0.5, 0.3, 0.7, 0.4, 0.6], dtype=F64))  # ranked within the row
    torch.testing.assert_close(p[1], torch.tensor([0.3, 0.4, 0.5, 0.6, 0.7], dtype=F64))
    torch.testing.assert_close(magprune_probs(tau[0], 0.5, 0.2), p[0])  # a 1-D tensor is one row
    u = torch.rand(2, 5)
    kept = magprune(tau, 0.5, 0.2, u, rescale=False) != 0
    assert torch.equal(kept, u.to(F64) >= 1 - p)


def test_della_with_epsilon_0_draws_dares_mask_and_matches_it_in_distribution():
    torch.manual_seed(3)
    tau = torch.randn(4000, dtype=F64)
    u = seeded_uniform(tau.shape, 7, "w", 1)
    della = magprune(tau, 0.5, 0.0, u, rescale=False)
    dare = dare_drop(tau, 0.5, 7, "w", 1)
    assert torch.equal(della != 0, dare != 0)  # the same mask
    torch.testing.assert_close(della[della != 0] * 2, dare[dare != 0])  # DARE rescales by 1 / (1 - drop)
    # in distribution: each keeps half the entries, and the rescaled task vectors average back to tau
    means = [
        torch.stack([f(s) for s in range(200)]).mean(0)
        for f in (
            lambda s: magprune(tau, 0.5, 0.0, seeded_uniform(tau.shape, s, "w", 0), rescale=True),
            lambda s: dare_drop(tau, 0.5, s, "w", 0),
        )
    ]
    for m in means:
        assert float((m - tau).norm() / tau.norm()) < 0.12  # sampling noise of 200 draws: ~ 1 / sqrt(200)


def test_della_mergers_are_seeded_and_reproducible():
    torch.manual_seed(4)
    base = torch.randn(6, 8, dtype=F64)
    taus = [torch.randn(6, 8, dtype=F64) for _ in range(3)]
    params = dict(density=0.5, epsilon=0.1)
    a = MERGERS["della"](seed=1, **params).merge_tensor(_inputs(taus, base))
    b = MERGERS["della"](seed=1, **params).merge_tensor(_inputs(taus, base))
    c = MERGERS["della"](seed=2, **params).merge_tensor(_inputs(taus, base))
    assert torch.equal(a, b) and not torch.equal(a, c)
    pruned = [magprune(t, 0.5, 0.1, seeded_uniform(t.shape, 1, "w", i)) for i, t in enumerate(taus)]
    torch.testing.assert_close(a, base + gta_combine(pruned, [1.0] * 3, consensus=True, normalize=True))
    lin = MERGERS["della-linear"](seed=1, **params).merge_tensor(_inputs(taus, base))
    torch.testing.assert_close(lin, base + sum(pruned))
    whole = MERGERS["della-linear"](density=1.0).merge_tensor(_inputs(taus, base))
    torch.testing.assert_close(whole, base + sum(taus))  # density 1: task arithmetic


# ------------------------------------------------------------------------------------------ sce


def test_sce_with_select_topk_1_is_the_mean_weighted_by_squared_task_vectors():
    # every task vector positive: nothing is erased, so sce = sum_i w_i tau_i / sum_i w_i, w_i = mean(tau_i ** 2)
    taus = [torch.full((3, 4), 1.0, dtype=F64), torch.full((3, 4), 2.0, dtype=F64), torch.full((3, 4), 3.0, dtype=F64)]
    taus[1][0, 0] = 0.5
    w = torch.stack([(t**2).mean() for t in taus])
    expected = sum(wi * t for wi, t in zip(w, taus, strict=True)) / w.sum()
    base = torch.ones(3, 4, dtype=F64)
    got = MERGERS["sce"]().merge_tensor(_inputs(taus, base))
    torch.testing.assert_close(got, base + expected)
    torch.testing.assert_close(sce_weights(torch.stack(taus)), w / w.sum())


def test_sce_selects_by_variance_and_erases_minority_signs():
    stacked = torch.tensor([[1.0, 5.0, 0.0, -1.0], [1.0, -5.0, 2.0, 3.0]], dtype=F64)  # variances 0, 25, 1, 4
    assert torch.equal(sce_select(stacked, 0.67), torch.tensor([False, True, False, True]))  # int(3 * 0.67) = 2
    out = sce_combine(list(stacked), 1.0)
    w = sce_weights(stacked)  # mean squares 6.75, 9.5 (normalised)
    # entry 1: 5 - 5 = 0 -> "+" wins, only model 0; entry 3: sum +2 -> model 1 only; entry 2: model 1 only
    torch.testing.assert_close(out, torch.tensor([1.0, 5.0, 2.0, 3.0], dtype=F64))
    assert torch.allclose(w.sum(), torch.tensor(1.0, dtype=F64))
    zero = torch.zeros(2, 3, dtype=F64)
    torch.testing.assert_close(sce_weights(zero), torch.full((2,), 0.5, dtype=F64))  # all zero: uniform


# ------------------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize(
    ("strategy", "params", "message"),
    [
        ("breadcrumbs", {"density": 0}, "density: Input should be greater than 0"),
        ("breadcrumbs-ties", {"density": 1.5}, "density: Input should be less than or equal to 1"),
        ("breadcrumbs", {"density": 0.95, "gamma": 0.1}, r"strategy breadcrumbs: density \+ gamma must be <= 1"),
        ("della", {"density": 0.1}, r"strategy della: density \+/- epsilon must lie inside \(0, 1\)"),
        ("della-linear", {"density": 0.9, "epsilon": 0.2}, r"density \+/- epsilon must lie inside"),
        ("sce", {"select_topk": 0}, "select_topk: Input should be greater than 0"),
        ("sce", {"weights": [1, 2]}, "strategy sce: sce weighs each model by its task vector's mean square"),
        ("della", {"lam": 1}, "lam: not a parameter of strategy della — choose from .*lambda"),
    ],
)
def test_bad_parameters_are_refused_in_one_line(strategy, params, message):
    with pytest.raises(ValueError, match=message) as err:
        merger_params(strategy, params)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("strategy", ["breadcrumbs", "breadcrumbs-ties", "della", "della-linear", "sce"])
def test_every_sparse_strategy_needs_a_base(strategy, tmp_path):
    taus = [torch.ones(3, dtype=F64)] * 2
    with pytest.raises(MissingStats, match=f"{strategy}: no base tensor for w; pass --base"):
        MERGERS[strategy]().merge_tensor(TensorInputs("w", taus, [0.5, 0.5]))
    a, b = (save_tiny_text_classifier(tmp_path / n, seed=i) for i, n in enumerate("ab"))
    with pytest.raises(MissingStats, match=f"strategy '{strategy}' works on task vectors: pass the base model"):
        merge_checkpoints(strategy, [a, b], tmp_path / "m")


# ------------------------------------------------------------------------------------------ end to end


def test_symfuse_merge_breadcrumbs_end_to_end(tmp_path):
    base, a, b = (save_tiny_text_classifier(tmp_path / n, seed=i) for i, n in enumerate(("base", "a", "b")))
    out = tmp_path / "m"
    res = run_cli(
        "merge", "--strategy", "breadcrumbs", "--models", a, b, "--base", base, "--weights", "1", "3",
        "--density", "0.5", "--param", "gamma=0.1", "--param", "lambda=0.8", "--out", out,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    got = load_file(out / "model.safetensors")
    ws = [load_file(f / "model.safetensors") for f in (base, a, b)]
    name = "bert.encoder.layer.1.output.dense.weight"
    w0, wa, wb = (w[name].to(F64) for w in ws)
    expected = w0 + 0.8 * (0.5 * breadcrumbs_prune(wa - w0, 0.5, 0.1) + 1.5 * breadcrumbs_prune(wb - w0, 0.5, 0.1))
    torch.testing.assert_close(got[name], expected.to(torch.float32))
    bad = run_cli("merge", "--strategy", "breadcrumbs", "--models", a, b, "--param", "gama=0.1", "--out", out / "x")
    assert bad.returncode != 0 and "gama" in bad.stderr and "gamma" in bad.stderr
