"""Closed-form solvers: orthogonal Procrustes (dense and RoPE-restricted), quartic scaling, assignment.

Notation: for one KV group, ``A`` (dh, n) is the source's stacked query-side columns and ``B`` (dh, m) its
key-side columns (or value-side / output-side for VO), ``A*`` / ``B*`` the anchor's. Cross matrices
``Ma = A* A^T`` and ``Mb = B* B^T`` (dh, dh) are all a solver needs besides norms: the rotation ``R`` maximises
``tr(R^T (Ma + Mb))`` (minimising ``||R [A|B] - [A*|B*]||``), and the scale ``a`` minimises
``||a R A - A*||² + ||R B / a - B*||²``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment

from symfuse.match.assignment import certified_sparse_assignment

log = logging.getLogger(__name__)


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` torch intra-op threads, then restore the previous count.

    The count is per calling thread (OpenMP / MKL thread-local settings), so worker threads may lower it without
    touching the main thread. Used for tiny LAPACK calls: MKL's threaded SVD of small matrices is 10-50x slower
    than the sequential one (thread start-up and barriers dominate), worse still when other processes share
    the cores.
    """
    prev = torch.get_num_threads()
    if prev == n:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


def procrustes(m: torch.Tensor) -> torch.Tensor:
    """Orthogonal ``R`` maximising ``tr(R^T M)``: ``U V^T`` for ``M = U S V^T`` (float64, batched (..., d, d)).

    One batched LAPACK call for all heads, run single-threaded (see :func:`torch_threads`).
    """
    with torch_threads(1):
        u, _, vh = torch.linalg.svd(m.to(torch.float64))
    return u @ vh


def rope_procrustes(m: torch.Tensor) -> torch.Tensor:
    """Best rotation commuting with RoPE (rotate_half pairs ``(i, i + d/2)``), maximising ``tr(R^T M)``.

    On each pair the 2x2 block ``[[c, -s], [s, c]]`` maximises ``c (M_ii + M_jj) + s (M_ji - M_ij)``:
    ``(c, s)`` is the unit vector along ``(M_ii + M_jj, M_ji - M_ij)``. Reflections do not commute with RoPE.
    """
    return _rope_rotation(_pair_vectors(m.to(torch.float64)))


def _rope_rotation(v: torch.Tensor) -> torch.Tensor:
    """RoPE rotation (..., d, d) whose pair ``i`` rotates by the angle of ``v[..., i, :]`` (identity where 0)."""
    x, y = v[..., 0], v[..., 1]
    h = x.shape[-1]
    i = torch.arange(h)
    norm = torch.sqrt(x * x + y * y)
    c = torch.where(norm > 0, x / norm.clamp_min(1e-300), torch.ones_like(x))
    s = torch.where(norm > 0, y / norm.clamp_min(1e-300), torch.zeros_like(y))
    r = torch.zeros(*x.shape[:-1], 2 * h, 2 * h, dtype=v.dtype)
    r[..., i, i] = c
    r[..., i + h, i + h] = c
    r[..., i, i + h] = -s
    r[..., i + h, i] = s
    return r


def block_sum(x: torch.Tensor, rope: bool) -> torch.Tensor:
    """Sum per-row values (..., dh) over scale blocks: the whole head, or RoPE pairs -> (..., 1 | dh/2)."""
    if rope:
        h = x.shape[-1] // 2
        return x[..., :h] + x[..., h:]
    return x.sum(-1, keepdim=True)


def block_expand(a: torch.Tensor, dh: int, rope: bool) -> torch.Tensor:
    """Inverse shape of :func:`block_sum`: per-block values to per-row (..., dh)."""
    if rope:
        return torch.cat([a, a], dim=-1)
    return a.expand(*a.shape[:-1], dh)


def solve_scale(aa: torch.Tensor, ab: torch.Tensor, bb: torch.Tensor, bab: torch.Tensor) -> torch.Tensor:
    """Positive ``a`` minimising ``f(a) = a²|A|² − 2a<A,A*> + |B|²/a² − 2<B,B*>/a`` (elementwise, batched).

    ``f'(a) = 0`` times ``a³/2`` is the quartic ``|A|² a⁴ − <A,A*> a³ + <B,B*> a − |B|² = 0``; among its real
    positive roots the one with the lowest ``f`` wins (polished by Newton steps). Degenerate blocks (zero norms)
    get ``a = 1``.

    Args:
        aa: ``|A|²`` (any shape, float64).
        ab: ``<A, A*>`` (same shape).
        bb: ``|B|²`` (same shape).
        bab: ``<B, B*>`` (same shape).
    """
    shape = aa.shape
    aa_, ab_, bb_, bab_ = (t.reshape(-1).double().numpy() for t in (aa, ab, bb, bab))
    out = np.ones_like(aa_)
    ok = (aa_ > 1e-300) & (bb_ > 1e-300)
    if ok.any():
        a4, a3, a1, a0 = aa_[ok], -ab_[ok], bab_[ok], -bb_[ok]
        n = a4.size
        comp = np.zeros((n, 4, 4))
        comp[:, 0, 0] = -a3 / a4
        comp[:, 0, 2] = -a1 / a4
        comp[:, 0, 3] = -a0 / a4
        comp[:, 1, 0] = comp[:, 2, 1] = comp[:, 3, 2] = 1.0
        roots = np.linalg.eigvals(comp)  # (n, 4)
        real = roots.real.copy()
        good = (np.abs(roots.imag) <= 1e-6 * np.maximum(1.0, np.abs(roots))) & (real > 0)
        real = np.where(good, real, 1.0)
        for _ in range(3):  # Newton on the quartic
            p = ((a4[:, None] * real + a3[:, None]) * real * real + a1[:, None]) * real + a0[:, None]
            dp = (4 * a4[:, None] * real + 3 * a3[:, None]) * real * real + a1[:, None]
            real = np.where(good & (np.abs(dp) > 0), real - p / np.where(dp == 0, 1, dp), real)
            real = np.where(real > 0, real, 1.0)

        def f(x: np.ndarray) -> np.ndarray:
            return x * x * aa_[ok, None] - 2 * x * ab_[ok, None] + bb_[ok, None] / (x * x) - 2 * bab_[ok, None] / x

        obj = np.where(good, f(real), np.inf)
        best = np.argmin(obj, axis=1)
        pick = real[np.arange(n), best]
        out[ok] = np.where(np.isfinite(obj[np.arange(n), best]), pick, 1.0)
    return torch.from_numpy(out).reshape(shape)


def scale_objective(
    a: torch.Tensor, aa: torch.Tensor, ab: torch.Tensor, bb: torch.Tensor, bab: torch.Tensor
) -> torch.Tensor:
    """``f(a)`` of :func:`solve_scale` (without the constant ``|A*|² + |B*|²``)."""
    return a * a * aa - 2 * a * ab + bb / (a * a) - 2 * bab / a


def fit_rotation_scale(
    ma: torch.Tensor,
    mb: torch.Tensor,
    na: torch.Tensor,
    nb: torch.Tensor,
    rotate: bool,
    scale: bool,
    rope: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotation and / or scale aligning source blocks to anchor blocks, batched over leading axes.

    Rotation alone (Procrustes) and scale alone (quartic) are exact global minimisers. Both together: the joint
    minimiser of :func:`joint_rotation_scale`, which depends only on the source's orbit under rotations and scales
    (so exactly equivalent sources match to the same weights).

    Args:
        ma: (..., dh, dh) ``A* A^T``.
        mb: (..., dh, dh) ``B* B^T``.
        na: (..., dh) squared row norms of ``A`` (source).
        nb: (..., dh) squared row norms of ``B`` (source).
        rotate: Solve for ``R`` (else identity).
        scale: Solve for the scale (else 1).
        rope: Restrict ``R`` to RoPE-commuting rotations and scales to frequency pairs.

    Returns:
        ``R`` (..., dh, dh), per-row scale (..., dh), and the objective without anchor norms (...,): the residual
        ``||a R A − A*||² + ||R B / a − B*||²`` minus ``|A*|² + |B*|²``.
    """
    dh = ma.shape[-1]
    aa = block_sum(na.double(), rope)
    bb = block_sum(nb.double(), rope)
    if rotate and scale:
        r, a, _ = joint_rotation_scale(ma, mb, aa, bb, rope)
    else:
        r = _rotation(ma.double(), mb.double(), torch.ones_like(aa), rope) if rotate else None
        if r is None:
            r = torch.eye(dh, dtype=torch.float64).expand_as(ma)
        ab, bab = _cross_terms(r, ma, mb, rope)
        a = solve_scale(aa, ab, bb, bab) if scale else torch.ones_like(aa)
    ab, bab = _cross_terms(r, ma, mb, rope)
    obj = scale_objective(a, aa, ab, bb, bab).sum(-1)
    return r, block_expand(a, dh, rope), obj


def _cross_terms(r: torch.Tensor, ma: torch.Tensor, mb: torch.Tensor, rope: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per scale block ``<R A, A*>`` and ``<R B, B*>``: per row ``sum_c R_rc M_rc`` (block rotations keep norms)."""
    return block_sum((r * ma).sum(-1), rope), block_sum((r * mb).sum(-1), rope)


def _rotation(ma: torch.Tensor, mb: torch.Tensor, a: torch.Tensor, rope: bool) -> torch.Tensor:
    """Best rotation for fixed per-block scales ``a``: it maximises ``tr(R^T (D Ma + D^-1 Mb))``, ``D = diag(a)``."""
    d = block_expand(a, ma.shape[-1], rope)[..., :, None]
    m = d * ma + mb / d
    return rope_procrustes(m) if rope else procrustes(m)


def _pair_vectors(m: torch.Tensor) -> torch.Tensor:
    """RoPE pairs ``(i, i + d/2)``: ``(M_ii + M_jj, M_ji − M_ij)`` (..., d/2, 2), whose length is the best score."""
    h = m.shape[-1] // 2
    i = torch.arange(h)
    return torch.stack([m[..., i, i] + m[..., i + h, i + h], m[..., i + h, i] - m[..., i, i + h]], dim=-1)


def _gram_eval(
    gaa: torch.Tensor, gs: torch.Tensor, gd: torch.Tensor, gbb: torch.Tensor, u: torch.Tensor, derivs: bool
) -> tuple[torch.Tensor, ...]:
    """``g(u) = ||e^u Va + e^-u Vb||_*`` (and ``g'``, ``g''``) from Grams of ``Va``, ``Vb`` (batch (N, d, d)).

    ``M^T M = x² Gaa + (Gab + Gab^T) + Gbb / x²`` (``x = e^u``): ``g`` is the sum of the square roots of its
    eigenvalues. With ``M = U S V^T``, ``N = dM/du`` and ``Ñ = U^T N V = S^-1 V^T (M^T N) V``:
    ``g' = tr Ñ`` and ``g'' = g + sum_{i<j} (Ñ_ij − Ñ_ji)² / (σ_i + σ_j)`` (``d²M/du² = M``).
    """
    x2 = torch.exp(2 * u)[:, None, None]
    gm = x2 * gaa + gs + gbb / x2
    with torch_threads(1):
        if not derivs:
            return (torch.linalg.eigvalsh(gm).clamp_min(0).sqrt().sum(-1),)
        lam, v = torch.linalg.eigh(gm)
    s = lam.clamp_min(0).sqrt()
    k = v.mT @ (x2 * gaa + gd - gbb / x2) @ v
    nt = k / s.clamp_min(1e-300)[:, :, None]
    d = nt - nt.mT
    g2 = s.sum(-1) + 0.5 * (d * d / (s[:, :, None] + s[:, None, :]).clamp_min(1e-300)).sum((-2, -1))
    return s.sum(-1), torch.diagonal(nt, dim1=-2, dim2=-1).sum(-1), g2


def _pair_eval(p: torch.Tensor, q: torch.Tensor, r: torch.Tensor, u: torch.Tensor, derivs: bool) -> tuple:
    """RoPE pair version of :func:`_gram_eval`: ``g = |e^u va + e^-u vb| = (x² p + 2 q + r / x²)^½`` (N,)."""
    x2 = torch.exp(2 * u)
    gg = (x2 * p + 2 * q + r / x2).clamp_min(0)
    g = gg.sqrt()
    if not derivs:
        return (g,)
    d1, d2 = 2 * (x2 * p - r / x2), 4 * (x2 * p + r / x2)
    gs = g.clamp_min(1e-300)
    return g, d1 / (2 * gs), d2 / (2 * gs) - d1 * d1 / (4 * gs**3)


def _h(u: torch.Tensor, g: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Balanced objective ``h(u) = m (x² + 1/x²) − 2 g`` (``x = e^u``)."""
    x2 = torch.exp(2 * u)
    return m * (x2 + 1 / x2) - 2 * g


def _piece_bounds(
    us: torch.Tensor,
    gv: torch.Tensor,
    m: torch.Tensor,
    ends: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    samples: int = 17,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lower bound of ``h`` on each piece between sorted points (K, N) and the bracket ends, and where to split it.

    ``g(u) = F(e^u, e^-u)`` with ``F(p, q) = ||p Va + q Vb||_*`` sublinear. Every point of the arc between two
    samples is a positive combination ``λ(u) P_i + μ(u) P_{i+1}`` of the end points, so
    ``g(u) <= λ g_i + μ g_{i+1} = P e^u + Q e^-u`` (``λ = sinh(u_{i+1} − u) / sinh d``); beyond the outer points
    the other end is the direction ``(1, 0)`` (value ``|Va|_*``) or ``(0, 1)`` (value ``|Vb|_*``). Hence
    ``h >= L(u) = m (x² + 1/x²) − 2 (P x + Q / x)``, an explicit function minimised on ``samples`` points, less
    ``δ²/8 max |L''|`` for the spacing ``δ`` (exact for any function with that curvature bound).

    Args:
        us: (K, N) sorted points inside the bracket.
        gv: (K, N) ``g`` there.
        m: (N,) balanced norm.
        ends: ``u_lo``, ``u_hi``, ``|Va|_*``, ``|Vb|_*`` (N,).
        samples: Points per piece on which ``L`` is minimised.

    Returns:
        Bounds (K+1, N) and split points (K+1, N): the sampled minimiser of ``L``, or the midpoint at an end.
    """
    u_lo, u_hi, ka, kb = ends
    u1, u2 = torch.cat([u_lo[None], us]), torch.cat([us, u_hi[None]])
    d = u2 - u1
    wide = d > 1e-6
    den = 2 * torch.sinh(torch.where(wide[1:-1], d[1:-1], torch.ones_like(d[1:-1])))
    e1, e2 = torch.exp(-u1[1:-1]), torch.exp(-u2[1:-1])
    g1, g2 = gv[:-1], gv[1:]
    p0, pk = us[0], us[-1]
    pp = torch.cat([(gv[0] * torch.exp(-p0) - kb * torch.exp(-2 * p0))[None], (g2 * e1 - g1 * e2) / den, ka[None]])
    qq = torch.cat([kb[None], (g1 / e2 - g2 / e1) / den, (gv[-1] * torch.exp(pk) - ka * torch.exp(2 * pk))[None]])
    t = torch.linspace(0, 1, samples, dtype=us.dtype)[:, None, None]
    uu = u1 + d * t
    ll = _h(uu, pp * torch.exp(uu) + qq * torch.exp(-uu), m)
    k = ll.argmin(0, keepdim=True)
    umax = torch.maximum(u1.abs(), u2.abs())
    curv = 8 * m * torch.cosh(2 * umax) + 2 * (pp.abs() + qq.abs()) * torch.exp(umax)
    lb = ll.gather(0, k)[0] - (d / (samples - 1)) ** 2 / 8 * curv
    hv = _h(us, gv, m)
    ends_h = torch.minimum(torch.cat([hv[:1], hv]), torch.cat([hv, hv[-1:]]))
    lb = torch.where(wide, lb, ends_h)
    arg = torch.where((k[0] == 0) | (k[0] == samples - 1), (u1 + u2) / 2, uu.gather(0, k)[0])
    return lb, arg


def joint_rotation_scale(
    ma: torch.Tensor,
    mb: torch.Tensor,
    aa: torch.Tensor,
    bb: torch.Tensor,
    rope: bool,
    grid: int = 0,
    tol: float = 1e-10,
    max_iter: int = 500,
    bb_rounds: int = 60,
    cells: int = 8,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Joint minimiser over rotations ``R`` and scales ``a`` of ``||a R A − A*||² + ||R B / a − B*||²`` per block.

    For fixed ``a`` the best ``R`` is the Procrustes solution of ``a Ma + Mb / a``, so the problem is one-dimensional
    in ``u = log a``: ``h(u) = a²|A|² + |B|²/a² − 2 max_R <R, a Ma + Mb/a>`` (nuclear norm; pair vector length
    under RoPE, where every frequency pair is its own block). Steps, all in the source's BALANCED coordinates
    (``a_c = (|B|/|A|)^½`` makes ``|a_c A| = |B / a_c|``, the orbit's canonical scale):

    1. a bracket ``[u_lo, u_hi]`` holding the minimiser, from ``h(u) <= h(0)`` and the triangle inequality
       ``max_R <R, x Ma + Mb/x> <= x |Ma|_* + |Mb|_* / x``;
    2. a certified global search (branch and bound, :func:`_piece_bounds`): starting from ``u = 0`` (plus
       ``grid`` points), split pieces of the bracket until no piece can beat the best point by more than
       ``1e-9 (m + |h|)``, except that point's own two cells, each at most ``1 / cells`` of the bracket (as fine
       as the old 16-point grid, which had no certificate elsewhere); nuclear norms are the square roots of the
       eigenvalues of ``M^T M``, a combination of three Grams computed once;
    3. from the best point, safeguarded Newton on ``h`` inside its two cells (exact ``h'``, ``h''`` from one
       eigendecomposition, see :func:`_gram_eval`; a bisection step towards descent when the Newton step leaves
       the shrinking bracket) until the step ``|Δ log a| < tol``, or the quadratic-convergence estimate of the
       next step ``|δ|³ / |δ_prev|²`` is below ``tol / 100``;
    4. the rotation at the result by one SVD, whose singular values give ``h`` there exactly: blocks whose
       ``h`` exceeds the best evaluated point's fall back to that point (so the result never loses to the search).

    Every step sees the source only through rotation-invariant quantities of its balanced representative and
    is rotation-equivariant, so sources ``S`` and ``T·S`` (``T`` any rotation and scale) get the same matched
    weights, up to floating point and ``tol``.

    Args:
        ma: (..., dh, dh) ``A* A^T``.
        mb: (..., dh, dh) ``B* B^T``.
        aa: (..., blocks) ``|A|²`` per scale block (1 per head, dh/2 with RoPE).
        bb: (..., blocks) ``|B|²`` per scale block.
        rope: Restrict ``R`` to RoPE-commuting rotations and scales to frequency pairs.
        grid: Extra evenly spaced starting points of the global search besides ``u = 0``.
        tol: Convergence tolerance on the Newton step ``|Δ log a|``.
        max_iter: Newton iterations at most (a warning is logged when reached).
        bb_rounds: Branch-and-bound rounds at most (a warning is logged when a block stays uncertified).
        cells: The best point's own cells (left to Newton) are at most ``1 / cells`` of the bracket.

    Returns:
        ``R`` (..., dh, dh) float64, scales (..., blocks) float64, Newton iterations.
    """
    f64 = torch.float64
    ma, mb, aa, bb = ma.to(f64), mb.to(f64), aa.to(f64), bb.to(f64)
    shape = aa.shape
    ok = (aa > 1e-300) & (bb > 1e-300)
    c = torch.where(ok, (bb / aa.clamp_min(1e-300)) ** 0.25, torch.ones_like(aa))  # balanced scale
    m = torch.where(ok, (aa * bb).sqrt(), torch.ones_like(aa)).reshape(-1)  # |c A|² = |B / c|²
    # everything below works on N independent 1-D problems (flattened blocks)
    if rope:
        va = (_pair_vectors(ma) * c[..., None]).reshape(-1, 2)
        vb = (_pair_vectors(mb) / c[..., None]).reshape(-1, 2)
        p, q, r = (va * va).sum(-1), (va * vb).sum(-1), (vb * vb).sum(-1)

        def ev(u: torch.Tensor, idx: torch.Tensor | None, derivs: bool) -> tuple:
            if idx is None:
                return _pair_eval(p, q, r, u, derivs)
            return _pair_eval(p[idx], q[idx], r[idx], u, derivs)

        ka, kb = p.sqrt(), r.sqrt()
    else:
        dh = ma.shape[-1]
        cc = c[..., None]
        va, vb = (ma * cc).reshape(-1, dh, dh), (mb / cc).reshape(-1, dh, dh)
        gaa, gbb, gab = va.mT @ va, vb.mT @ vb, va.mT @ vb
        gs, gd = gab + gab.mT, gab.mT - gab

        def ev(u: torch.Tensor, idx: torch.Tensor | None, derivs: bool) -> tuple:
            if idx is None:
                return _gram_eval(gaa, gs, gd, gbb, u, derivs)
            return _gram_eval(gaa[idx], gs[idx], gd[idx], gbb[idx], u, derivs)

        with torch_threads(1):
            kab = torch.linalg.eigvalsh(torch.stack([gaa, gbb, gaa + gs + gbb])).clamp_min(0).sqrt().sum(-1)
        ka, kb, k0 = kab[0], kab[1], kab[2]
    # eigenvalue-based norms: widen the bracket by their rounding (upper bounds up, the lower bound down)
    ka, kb = ka * (1 + 1e-7), kb * (1 + 1e-7)
    if rope:
        k0 = ev(torch.zeros_like(m), None, False)[0]
    k0 = k0 * (1 - 1e-7)

    def side(k1: torch.Tensor, k2: torch.Tensor) -> torch.Tensor:
        # m x² − 2 k1 x <= 2m − 2 k0 + 2 k2 for the minimiser at x = e^{±u} >= 1
        cc = (2 * m - 2 * k0 + 2 * k2).clamp_min(0)
        return torch.log((k1 + (k1 * k1 + m * cc).sqrt()) / m).clamp_min(0)

    u_hi, u_lo = side(ka, kb), -side(kb, ka)
    cols = torch.arange(m.numel())
    zero = torch.zeros_like(m)
    us = torch.cat([zero[None], u_lo + (u_hi - u_lo) * (torch.arange(1, grid + 1, dtype=f64) / (grid + 1))[:, None]])
    gv = torch.cat([k0[None] / (1 - 1e-7), ev(us[1:], None, False)[0] if rope else us[1:]])
    if not rope:
        for i in range(1, grid + 1):
            gv[i] = ev(us[i], None, False)[0]
    order = us.argsort(dim=0, stable=True)
    us, gv = us.gather(0, order), gv.gather(0, order)
    width = (u_hi - u_lo) / cells
    rounds = 0
    while True:  # branch and bound: split pieces whose lower bound may beat the best point
        hs = _h(us, gv, m)
        best = hs.argmin(0)
        best_h = hs[best, cols]
        lb, arg = _piece_bounds(us, gv, m, (u_lo, u_hi, ka, kb))
        ub = us[best, cols]
        left, right = torch.cat([u_lo[None], us]), torch.cat([us, u_hi[None]])
        own = (left == ub) | (right == ub)
        small = right - left <= width
        lb = torch.where(own & small, torch.inf, lb)  # the best point's own cells (narrow): Newton's
        # wide ones are cut at ``width`` from the best point
        arg = torch.where(own, torch.where(left == ub, ub + 0.999 * width, ub - 0.999 * width), arg)
        worst = lb.argmin(0)
        need = lb[worst, cols] < best_h - 1e-9 * (m + best_h.abs())
        if not bool(need.any()) or rounds >= bb_rounds:
            break
        rounds += 1
        idx = need.nonzero()[:, 0]
        new_u, new_g = us[-1].clone(), gv[-1].clone()  # certified blocks: a copy of the last point
        new_u[idx] = arg[worst, cols][idx]
        new_g[idx] = ev(new_u[idx], idx, False)[0]
        us, gv = torch.cat([us, new_u[None]]), torch.cat([gv, new_g[None]])
        order = us.argsort(dim=0, stable=True)
        us, gv = us.gather(0, order), gv.gather(0, order)
    if bool(need.any()):
        log.warning("joint rotation / scale: %d blocks not certified in %d rounds", int(need.sum()), rounds)
    log.debug("joint rotation / scale: global search certified after %d rounds", rounds)
    u = us[best, cols]
    best_u = u.clone()
    last = us.shape[0] - 1
    lo = torch.where(best > 0, us[(best - 1).clamp_min(0), cols], u_lo)
    hi = torch.where(best < last, us[(best + 1).clamp_max(last), cols], u_hi)
    active = torch.arange(m.numel())
    it = 0
    prev = torch.full_like(m, torch.inf)  # previous Newton step per block
    while active.numel() and it < max_iter:
        it += 1
        ua, ma_ = u[active], m[active]
        g, g1, g2 = ev(ua, active, True)
        x2 = torch.exp(2 * ua)
        h = ma_ * (x2 + 1 / x2) - 2 * g
        hp = 2 * ma_ * (x2 - 1 / x2) - 2 * g1
        hpp = 4 * ma_ * (x2 + 1 / x2) - 2 * g2
        better = h < best_h[active]
        best_h[active] = torch.where(better, h, best_h[active])
        best_u[active] = torch.where(better, ua, best_u[active])
        la = torch.where(hp < 0, torch.maximum(lo[active], ua), lo[active])
        ha = torch.where(hp > 0, torch.minimum(hi[active], ua), hi[active])
        new = ua - hp / torch.where(hpp > 0, hpp, torch.ones_like(hpp))
        bad = (hpp <= 0) | ~(new >= la) | ~(new <= ha)
        new = torch.where(bad, torch.where(hp > 0, (ua + la) / 2, (ua + ha) / 2), new)
        lo[active], hi[active], u[active] = la, ha, new
        step = (new - ua).abs()
        # quadratic convergence: the next step would be about |δ|³ / |δ_prev|² (Newton steps only)
        pa = prev[active]
        quad = ~bad & torch.isfinite(pa) & (step < 1e-2 * pa) & (step**3 < 1e-2 * tol * pa**2)
        prev[active] = torch.where(bad, torch.inf, step)
        active = active[(step >= tol) & (hp != 0) & ~quad]
    if active.numel():
        log.warning("joint rotation / scale: no convergence in %d iterations (%d blocks)", it, active.numel())
    else:
        log.debug("joint rotation / scale: converged in %d iterations", it)
    pairs = (va, vb) if rope else None
    rot, h_end = _rotation_at(ma, mb, c, u.reshape(shape), m.reshape(shape), pairs)
    # rounding slack: at convergence h_end ~ best_h, and a coin flip must not pick an earlier iterate
    worse = h_end.reshape(-1) > best_h + 1e-11 * (m + best_h.abs())
    if bool(worse.any()):  # never lose to an evaluated point (grid or Newton iterate)
        u = torch.where(worse, best_u, u)
        rot, _ = _rotation_at(ma, mb, c, u.reshape(shape), m.reshape(shape), pairs)
    return rot, c * u.reshape(shape).exp(), it


def _rotation_at(
    ma: torch.Tensor, mb: torch.Tensor, c: torch.Tensor, u: torch.Tensor, m: torch.Tensor, pairs: tuple | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Best rotation at scales ``c e^u`` and the balanced objective ``h(u)`` per block (one SVD, or closed form).

    ``pairs``: under RoPE, the balanced pair vectors ``(va, vb)`` (N, 2) of :func:`joint_rotation_scale`.
    """
    x2 = torch.exp(2 * u)
    if pairs is not None:
        x = torch.exp(u).reshape(-1, 1)
        w = (x * pairs[0] + pairs[1] / x).reshape(*u.shape, 2)
        return _rope_rotation(w), m * (x2 + 1 / x2) - 2 * w.norm(dim=-1)
    d = (c * u.exp())[..., :, None]
    mat = d * ma + mb / d
    with torch_threads(1):
        uu, s, vh = torch.linalg.svd(mat)
    return uu @ vh, m * (x2 + 1 / x2) - 2 * s.sum(-1, keepdim=True)


def assign_max(sim: torch.Tensor, sparse_from: int = 256) -> tuple[torch.Tensor, bool]:
    """Permutation ``perm`` maximising ``sum_j sim[perm[j], j]`` (rows: source, columns: anchor).

    Exact paths, tried in order:

    1. every row's argmax is a different column: taking each row's maximum is optimal (no assignment can beat a
       per-row maximum in every row), so no solver runs. Likewise for columns (checked when at least 90 % of
       the columns are some row's argmax; otherwise their argmaxes cannot all be distinct in practice).
    2. ``n >= sparse_from``: sparse solve certified by LP duality
       (:func:`symfuse.match.assignment.certified_sparse_assignment`, 5-10x faster than the dense solvers).
    3. otherwise, or without a certificate: scipy's ``linear_sum_assignment`` on a float64 copy.

    Args:
        sim: (n, n) similarity, any float dtype (consumed: negated in place; do not reuse it).
        sparse_from: Smallest ``n`` for path 2.

    Returns:
        ``perm`` (n,) int64 (anchor position j takes source row ``perm[j]``), and whether a solver ran.
    """
    n = sim.shape[0]
    col_of_row = sim.argmax(dim=1)
    hits = torch.bincount(col_of_row, minlength=n)
    if hits.max() == 1:
        perm = torch.empty(n, dtype=torch.long)
        perm[col_of_row] = torch.arange(n)
        return perm, False
    # the column argmaxes are all distinct only when the rows' nearly are; when they are far from it (unrelated
    # models: ~1/e of the columns unclaimed) skip this check: argmax over dim 0 is a slow strided reduction
    if (hits > 0).float().mean() >= 0.9:
        row_of_col = sim.argmax(dim=0)
        if torch.bincount(row_of_col, minlength=n).max() == 1:
            return row_of_col.long(), False
    cost = sim.neg_()
    perm = torch.empty(n, dtype=torch.long)
    if n >= sparse_from:
        x = certified_sparse_assignment(cost)
        if x is not None:
            perm[x] = torch.arange(n)
            return perm, True
    rows, cols = linear_sum_assignment(cost.to(torch.float64).numpy())
    perm[torch.from_numpy(cols)] = torch.from_numpy(rows).long()
    return perm, True
