"""Closed-form solvers are optimal: Procrustes (dense and RoPE), quartic scaling, assignment fast path."""

import logging

import numpy as np
import pytest
import torch
from scipy.optimize import linear_sum_assignment

from symfuse.match.closed_form import (
    assign_max,
    fit_rotation_scale,
    procrustes,
    rope_procrustes,
    scale_objective,
    solve_scale,
)
from symfuse.match.joint import joint_rotation_scale
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


def _blocks(g, n, dh, cols, noise):
    """Anchor blocks and a related source (anchor + noise), as the solver's statistics."""
    at, bt = (torch.randn(n, dh, cols, generator=g, dtype=torch.float64) for _ in range(2))
    a = at + noise * torch.randn(n, dh, cols, generator=g, dtype=torch.float64)
    b = bt + noise * torch.randn(n, dh, cols, generator=g, dtype=torch.float64)
    return a, b, at, bt


def _fit(a, b, at, bt, rope):
    return fit_rotation_scale(at @ a.mT, bt @ b.mT, (a * a).sum(-1), (b * b).sum(-1), True, True, rope)


def _residual(r, s, a, b, at, bt):
    return ((s[..., None] * (r @ a) - at) ** 2).sum((-2, -1)) + (((r @ b) / s[..., None] - bt) ** 2).sum((-2, -1))


@pytest.mark.parametrize("rope", [False, True])
def test_joint_rotation_scale_depends_only_on_the_orbit(rope):
    # S and T.S (T = exact rotation + scale) must land on the same matched blocks; the one-pass fit did not
    g = torch.Generator().manual_seed(4)
    n, dh = 5, 8
    for noise in (0.3, 3.0):  # related and unrelated models
        a, b, at, bt = _blocks(g, n, dh, 40, noise)
        if rope:
            rot = rope_rotation((torch.rand(n, dh // 2, generator=g, dtype=torch.float64) * 2 - 1) * torch.pi)
            sc = torch.exp(torch.randn(n, dh // 2, generator=g, dtype=torch.float64)).repeat(1, 2)
        else:
            rot = random_orthogonal(dh, n, g)
            sc = torch.exp(torch.randn(n, 1, generator=g, dtype=torch.float64)).expand(n, dh)
        a2, b2 = sc[..., None] * (rot @ a), (rot @ b) / sc[..., None]
        r1, s1, o1 = _fit(a, b, at, bt, rope)
        r2, s2, o2 = _fit(a2, b2, at, bt, rope)
        m1 = torch.cat([s1[..., None] * (r1 @ a), (r1 @ b) / s1[..., None]], -1)
        m2 = torch.cat([s2[..., None] * (r2 @ a2), (r2 @ b2) / s2[..., None]], -1)
        assert float((m1 - m2).norm() / m1.norm()) < 1e-9
        torch.testing.assert_close(o1, o2, rtol=1e-10, atol=1e-9)
        # reported objective = the residual minus the anchor norms
        res = _residual(r1, s1, a, b, at, bt)
        torch.testing.assert_close(o1, res - (at**2).sum((-2, -1)) - (bt**2).sum((-2, -1)), rtol=1e-9, atol=1e-8)


def test_joint_rotation_scale_is_the_global_minimiser_and_beats_one_pass():
    g = torch.Generator().manual_seed(5)
    for noise in (0.2, 1.0, 5.0):
        a, b, at, bt = _blocks(g, 6, 6, 20, noise)
        b = 4.0 * b  # unbalanced source: the one-pass fit (rotation at scale 1, then scale) is far from optimal
        r, s, _ = _fit(a, b, at, bt, False)
        best = _residual(r, s, a, b, at, bt)
        # brute force: for every scale on a fine log grid the best rotation is Procrustes (exact)
        ma, mb = at @ a.mT, bt @ b.mT
        xs = torch.logspace(-2, 2, 2001, dtype=torch.float64)[:, None, None, None]
        rx = procrustes(xs * ma + mb / xs)  # (2001, 6, 6, 6), one batched call
        brute = _residual(rx, xs[..., 0].expand(-1, 6, 6), a, b, at, bt).min(0).values
        assert bool((best <= brute + 1e-9 * brute).all()), (best - brute).max()
        # one pass, as before: rotation for scale 1, then the quartic scale for that rotation
        r0 = procrustes(ma + mb)
        ab, bab = (r0 * ma).sum((-2, -1)), (r0 * mb).sum((-2, -1))
        s0 = solve_scale((a * a).sum((-2, -1)), ab, (b * b).sum((-2, -1)), bab)
        assert bool((best <= _residual(r0, s0[:, None].expand(6, 6), a, b, at, bt) + 1e-9).all())


def test_joint_rotation_scale_recovers_a_planted_transform_and_logs_iterations(caplog):
    g = torch.Generator().manual_seed(6)
    n, dh = 3, 8
    at, bt = (torch.randn(n, dh, 30, generator=g, dtype=torch.float64) for _ in range(2))
    rot = random_orthogonal(dh, n, g)
    sc = torch.tensor([0.05, 1.0, 20.0], dtype=torch.float64)[:, None, None]  # badly scaled heads
    a, b = sc * (rot @ at), (rot @ bt) / sc
    with caplog.at_level(logging.DEBUG, logger="symfuse.match.joint"):
        r, s, _ = _fit(a, b, at, bt, False)
    torch.testing.assert_close(s[:, 0], 1 / sc[:, 0, 0], rtol=1e-10, atol=0)
    torch.testing.assert_close(r @ rot, torch.eye(dh, dtype=torch.float64).expand(n, dh, dh), atol=1e-10, rtol=0)
    assert any("converged in" in m for m in caplog.messages)
    _, _, it = joint_rotation_scale(
        at @ a.mT, bt @ b.mT, (a * a).sum((-2, -1))[:, None], (b * b).sum((-2, -1))[:, None], False
    )
    assert 1 <= it < 500
