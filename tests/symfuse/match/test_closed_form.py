"""Closed-form solvers are optimal: Procrustes (dense and RoPE), quartic scaling, assignment fast path."""

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment

from symfuse.match.closed_form import assign_max, procrustes, rope_procrustes, scale_objective, solve_scale
from symfuse.symmetry import random_orthogonal, rope_rotation


def test_procrustes_beats_every_random_orthogonal_map():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(8, 30, generator=g, dtype=torch.float64)
    target = torch.randn(8, 30, generator=g, dtype=torch.float64)
    r = procrustes(target @ a.T)
    assert torch.allclose(r @ r.T, torch.eye(8, dtype=torch.float64), atol=1e-12)
    best = float((r @ a - target).norm())
    others = random_orthogonal(8, 500, g)
    assert best <= float((others @ a - target).norm(dim=(-2, -1)).min()) - 1e-9
    # local optimality too: small perturbations of R never do better
    for q in random_orthogonal(8, 50, g):
        near = procrustes(r + 1e-3 * q)
        assert float((near @ a - target).norm()) >= best - 1e-12


def test_rope_procrustes_is_optimal_among_rope_rotations():
    g = torch.Generator().manual_seed(1)
    a = torch.randn(8, 30, generator=g, dtype=torch.float64)
    target = torch.randn(8, 30, generator=g, dtype=torch.float64)
    r = rope_procrustes(target @ a.T)
    best = float((r @ a - target).norm())
    angles = (torch.rand(2000, 4, generator=g, dtype=torch.float64) * 2 - 1) * torch.pi
    others = rope_rotation(angles)
    assert best <= float((others @ a - target).norm(dim=(-2, -1)).min()) + 1e-12
    # recovers a planted RoPE rotation exactly
    planted = rope_rotation(torch.tensor([[0.3, -2.0, 1.0, 2.9]]))[0]
    rec = rope_procrustes(a @ (planted @ a).T)
    torch.testing.assert_close(rec @ planted, torch.eye(8, dtype=torch.float64), atol=1e-10, rtol=0)


def test_quartic_scale_is_the_global_minimiser():
    g = torch.Generator().manual_seed(2)
    for _ in range(20):
        a, at, b, bt = (torch.randn(6, 9, generator=g, dtype=torch.float64) for _ in range(4))
        at = at + 2 * a  # correlated, like real matches
        aa, ab, bb, bab = (x.reshape(1) for x in ((a * a).sum(), (a * at).sum(), (b * b).sum(), (b * bt).sum()))
        s = solve_scale(aa, ab, bb, bab)
        grid = torch.logspace(-3, 3, 20001, dtype=torch.float64)
        assert float(scale_objective(s, aa, ab, bb, bab)) <= float(scale_objective(grid, aa, ab, bb, bab).min()) + 1e-9
        # stationary point of f
        eps = 1e-6 * float(s)
        d = scale_objective(s + eps, aa, ab, bb, bab) - scale_objective(s - eps, aa, ab, bb, bab)
        assert abs(float(d)) / (2 * eps) < 1e-4 * (float(aa) + float(bb))
    # planted: A = c A*, B = B*/c  ->  a = 1/c exactly
    c = 1.7
    at, bt = torch.randn(5, 5, generator=g, dtype=torch.float64), torch.randn(5, 5, generator=g, dtype=torch.float64)
    a, b = c * at, bt / c
    s = solve_scale(*(x.reshape(1) for x in ((a * a).sum(), (a * at).sum(), (b * b).sum(), (b * bt).sum())))
    assert abs(float(s) - 1 / c) < 1e-12


def test_assignment_fast_path_is_exact_and_hungarian_otherwise():
    g = torch.Generator().manual_seed(3)
    n = 60
    perm = torch.randperm(n, generator=g)
    sim = 0.1 * torch.randn(n, n, generator=g)
    sim[perm, torch.arange(n)] += 5.0  # planted: every row's argmax is its match
    got, ran = assign_max(sim.clone())
    assert not ran and torch.equal(got, perm)
    dense = torch.randn(n, n, generator=g)
    got, ran = assign_max(dense.clone())
    rows, cols = linear_sum_assignment(-dense.double().numpy())
    assert ran
    assert np.isclose(float(dense[got, torch.arange(n)].sum()), float(dense.numpy()[rows, cols].sum()), atol=1e-4)


def test_sketch_certificate_agrees_with_full_hungarian():
    from symfuse.match.sketch import certified_nearest
    from symfuse.match.weights import ffn_similarity, match_ffn
    from symfuse.symmetry import FFNPermutation

    g = torch.Generator().manual_seed(4)
    n, d = 300, 40
    anc = {
        "up": torch.randn(n, d, generator=g),
        "gate": torch.randn(n, d, generator=g),
        "up_bias": torch.randn(n, generator=g),
        "down": torch.randn(d, n, generator=g),
    }
    perm = torch.randperm(n, generator=g)
    src = {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in FFNPermutation(perm).apply(anc).items()}
    nn = certified_nearest(src, anc, k=16)
    assert nn is not None and torch.equal(nn, ffn_similarity(src, anc).argmax(1))  # exact row argmax
    fast = match_ffn(src, anc, ["ffn-permutation"]).parts[0].perm
    rows, cols = linear_sum_assignment(-ffn_similarity(src, anc).double().numpy())
    assert torch.equal(fast[torch.from_numpy(cols)], torch.from_numpy(rows))
    assert torch.equal(perm[fast], torch.arange(n))
    # independent models: no certificate, the full Hungarian path answers (same optimum as scipy)
    other = {k: torch.randn(v.shape, generator=g) for k, v in anc.items()}
    assert certified_nearest(other, anc, k=16) is None
    slow = match_ffn(other, anc, ["ffn-permutation"]).parts[0].perm
    sim = ffn_similarity(other, anc)
    rows, cols = linear_sum_assignment(-sim.double().numpy())
    assert np.isclose(float(sim[slow, torch.arange(n)].sum()), float(sim.numpy()[rows, cols].sum()), rtol=1e-5)
