"""Joint rotation + scaling per head: the minimiser over both that depends only on the source's orbit.

Split from :mod:`symfuse.match.closed_form` (which calls :func:`joint_rotation_scale` from
:func:`~symfuse.match.closed_form.fit_rotation_scale` when both symmetries are on).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple

import torch

from symfuse.match.rope_pairs import pair_vectors, rope_rotation
from symfuse.runtime import torch_threads

log = logging.getLogger(__name__)


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


class _Balanced(NamedTuple):
    """The per-block problems in the source's balanced coordinates (flattened to N independent 1-D problems)."""

    c: torch.Tensor  # balanced scale per block (block shape)
    m: torch.Tensor  # (N,) |c A|² = |B / c|²
    ev: Callable[..., tuple]  # (u, idx, derivs) -> g (and g', g'') on blocks idx (all when None)
    ka: torch.Tensor  # (N,) upper bound of |Va|_*
    kb: torch.Tensor  # (N,) upper bound of |Vb|_*
    k0: torch.Tensor  # (N,) lower bound of g(0)
    pairs: tuple | None  # under RoPE, the balanced pair vectors (va, vb)


def _balanced(ma: torch.Tensor, mb: torch.Tensor, aa: torch.Tensor, bb: torch.Tensor, rope: bool) -> _Balanced:
    """Rescale to the orbit's canonical scale and precompute what every evaluation of ``g`` needs."""
    ok = (aa > 1e-300) & (bb > 1e-300)
    c = torch.where(ok, (bb / aa.clamp_min(1e-300)) ** 0.25, torch.ones_like(aa))
    m = torch.where(ok, (aa * bb).sqrt(), torch.ones_like(aa)).reshape(-1)
    if rope:
        va = (pair_vectors(ma) * c[..., None]).reshape(-1, 2)
        vb = (pair_vectors(mb) / c[..., None]).reshape(-1, 2)
        p, q, r = (va * va).sum(-1), (va * vb).sum(-1), (vb * vb).sum(-1)

        def ev(u: torch.Tensor, idx: torch.Tensor | None, derivs: bool) -> tuple:
            if idx is None:
                return _pair_eval(p, q, r, u, derivs)
            return _pair_eval(p[idx], q[idx], r[idx], u, derivs)

        ka, kb, pairs = p.sqrt(), r.sqrt(), (va, vb)
        k0 = ev(torch.zeros_like(m), None, False)[0]
    else:
        dh, cc = ma.shape[-1], c[..., None]
        va, vb = (ma * cc).reshape(-1, dh, dh), (mb / cc).reshape(-1, dh, dh)
        gaa, gbb, gab = va.mT @ va, vb.mT @ vb, va.mT @ vb
        gs, gd = gab + gab.mT, gab.mT - gab

        def ev(u: torch.Tensor, idx: torch.Tensor | None, derivs: bool) -> tuple:
            if idx is None:
                return _gram_eval(gaa, gs, gd, gbb, u, derivs)
            return _gram_eval(gaa[idx], gs[idx], gd[idx], gbb[idx], u, derivs)

        with torch_threads(1):
            kab = torch.linalg.eigvalsh(torch.stack([gaa, gbb, gaa + gs + gbb])).clamp_min(0).sqrt().sum(-1)
        ka, kb, k0, pairs = kab[0], kab[1], kab[2], None
    # eigenvalue-based norms: widen the bracket by their rounding (upper bounds up, the lower bound down)
    return _Balanced(c, m, ev, ka * (1 + 1e-7), kb * (1 + 1e-7), k0 * (1 - 1e-7), pairs)


def _bracket(pb: _Balanced) -> tuple[torch.Tensor, torch.Tensor]:
    """``[u_lo, u_hi]`` holding every minimiser, from ``h(u) <= h(0)`` and the triangle inequality."""
    m, k0 = pb.m, pb.k0

    def side(k1: torch.Tensor, k2: torch.Tensor) -> torch.Tensor:
        # m x² − 2 k1 x <= 2m − 2 k0 + 2 k2 for the minimiser at x = e^{±u} >= 1
        cc = (2 * m - 2 * k0 + 2 * k2).clamp_min(0)
        return torch.log((k1 + (k1 * k1 + m * cc).sqrt()) / m).clamp_min(0)

    return -side(pb.kb, pb.ka), side(pb.ka, pb.kb)


def _sorted(us: torch.Tensor, gv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = us.argsort(dim=0, stable=True)
    return us.gather(0, order), gv.gather(0, order)


def _global_search(
    pb: _Balanced, u_lo: torch.Tensor, u_hi: torch.Tensor, grid: int, cells: int, bb_rounds: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Branch and bound over the bracket: evaluated points (K, N) sorted, the best one's index and ``h`` (N,).

    Splits pieces whose lower bound (:func:`_piece_bounds`) may beat the best point by more than
    ``1e-9 (m + |h|)``, except the best point's own cells, at most ``1 / cells`` of the bracket (left to Newton).
    """
    m, ev = pb.m, pb.ev
    cols, zero = torch.arange(m.numel()), torch.zeros_like(m)
    frac = torch.arange(1, grid + 1, dtype=m.dtype) / (grid + 1)
    us = torch.cat([zero[None], u_lo + (u_hi - u_lo) * frac[:, None]])
    gv = torch.cat([pb.k0[None] / (1 - 1e-7), torch.stack([ev(u, None, False)[0] for u in us[1:]]) if grid else us[1:]])
    us, gv = _sorted(us, gv)
    width = (u_hi - u_lo) / cells
    rounds = 0
    while True:
        hs = _h(us, gv, m)
        best = hs.argmin(0)
        best_h = hs[best, cols]
        lb, arg = _piece_bounds(us, gv, m, (u_lo, u_hi, pb.ka, pb.kb))
        ub = us[best, cols]
        left, right = torch.cat([u_lo[None], us]), torch.cat([us, u_hi[None]])
        own = (left == ub) | (right == ub)
        lb = torch.where(own & (right - left <= width), torch.inf, lb)  # the best point's own cells (narrow)
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
        us, gv = _sorted(torch.cat([us, new_u[None]]), torch.cat([gv, new_g[None]]))
    if bool(need.any()):
        log.warning("joint rotation / scale: %d blocks not certified in %d rounds", int(need.sum()), rounds)
    log.debug("joint rotation / scale: global search certified after %d rounds", rounds)
    return us, best, best_h


def _newton(
    pb: _Balanced, u: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, best_h: torch.Tensor, tol: float, max_iter: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Safeguarded Newton on ``h`` inside ``[lo, hi]`` per block: the result, the best evaluated point and its ``h``.

    A bisection step towards descent replaces a Newton step that leaves the shrinking bracket; a block stops when
    ``|Δu| < tol`` or the quadratic-convergence estimate of its next step ``|δ|³ / |δ_prev|²`` is below ``tol / 100``.
    Returns new tensors (the inputs are not changed) and the number of iterations.
    """
    m = pb.m
    u, lo, hi, best_h = u.clone(), lo.clone(), hi.clone(), best_h.clone()
    best_u = u.clone()
    active = torch.arange(m.numel())
    it = 0
    prev = torch.full_like(m, torch.inf)  # previous Newton step per block
    while active.numel() and it < max_iter:
        it += 1
        ua, ma_ = u[active], m[active]
        g, g1, g2 = pb.ev(ua, active, True)
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
    return u, best_u, best_h, it


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
    pb = _balanced(ma, mb, aa, bb, rope)
    u_lo, u_hi = _bracket(pb)
    us, best, best_h = _global_search(pb, u_lo, u_hi, grid, cells, bb_rounds)
    cols, last = torch.arange(pb.m.numel()), us.shape[0] - 1
    lo = torch.where(best > 0, us[(best - 1).clamp_min(0), cols], u_lo)
    hi = torch.where(best < last, us[(best + 1).clamp_max(last), cols], u_hi)
    u, best_u, best_h, it = _newton(pb, us[best, cols], lo, hi, best_h, tol, max_iter)
    m = pb.m.reshape(shape)
    rot, h_end = _rotation_at(ma, mb, pb.c, u.reshape(shape), m, pb.pairs)
    # rounding slack: at convergence h_end ~ best_h, and a coin flip must not pick an earlier iterate
    worse = h_end.reshape(-1) > best_h + 1e-11 * (pb.m + best_h.abs())
    if bool(worse.any()):  # never lose to an evaluated point (grid or Newton iterate)
        u = torch.where(worse, best_u, u)
        rot, _ = _rotation_at(ma, mb, pb.c, u.reshape(shape), m, pb.pairs)
    return rot, pb.c * u.reshape(shape).exp(), it


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
        return rope_rotation(w), m * (x2 + 1 / x2) - 2 * w.norm(dim=-1)
    d = (c * u.exp())[..., :, None]
    mat = d * ma + mb / d
    with torch_threads(1):
        uu, s, vh = torch.linalg.svd(mat)
    return uu @ vh, m * (x2 + 1 / x2) - 2 * s.sum(-1, keepdim=True)
