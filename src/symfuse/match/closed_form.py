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
    m = m.to(torch.float64)
    h = m.shape[-1] // 2
    i = torch.arange(h)
    x = m[..., i, i] + m[..., i + h, i + h]
    y = m[..., i + h, i] - m[..., i, i + h]
    norm = torch.sqrt(x * x + y * y)
    c = torch.where(norm > 0, x / norm.clamp_min(1e-300), torch.ones_like(x))
    s = torch.where(norm > 0, y / norm.clamp_min(1e-300), torch.zeros_like(y))
    r = torch.zeros_like(m)
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


def _best_score(ma: torch.Tensor, mb: torch.Tensor, x: torch.Tensor, rope: bool) -> torch.Tensor:
    """``max_R <R, x Ma + Mb / x>`` per scale block (x (..., blocks)): nuclear norm, or pair vector length (RoPE)."""
    if rope:  # ma / mb are pair vectors (..., dh/2, 2)
        return (x[..., None] * ma + mb / x[..., None]).norm(dim=-1)
    with torch_threads(1):
        return torch.linalg.svdvals(x[..., None] * ma + mb / x[..., None]).sum(-1, keepdim=True)


def joint_rotation_scale(
    ma: torch.Tensor,
    mb: torch.Tensor,
    aa: torch.Tensor,
    bb: torch.Tensor,
    rope: bool,
    grid: int = 0,
    tol: float = 1e-10,
    max_iter: int = 500,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Joint minimiser over rotations ``R`` and scales ``a`` of ``||a R A − A*||² + ||R B / a − B*||²`` per block.

    For fixed ``a`` the best ``R`` is the Procrustes solution of ``a Ma + Mb / a``, so the problem is one-dimensional
    in ``u = log a``: ``h(u) = a²|A|² + |B|²/a² − 2 max_R <R, a Ma + Mb/a>`` (nuclear norm; pair vector length
    under RoPE, where every frequency pair is its own block). Steps, all in the source's BALANCED coordinates
    (``a_c = (|B|/|A|)^½`` makes ``|a_c A| = |B / a_c|``, the orbit's canonical scale):

    1. a bracket ``[u_lo, u_hi]`` holding the minimiser, from ``h(u) <= h(0)`` and the triangle inequality
       ``max_R <R, x Ma + Mb/x> <= x |Ma|_* + |Mb|_* / x``;
    2. ``h`` on ``grid`` points of the bracket (a global search: ``h`` need not be unimodal);
    3. from the best grid point, block-coordinate descent (Procrustes for ``R``, quartic for ``a``: each step
       minimises the objective exactly over its block, so it never increases) until ``|Δ log a| < tol``.

    Every step sees the source only through rotation-invariant quantities of its balanced representative and
    is rotation-equivariant, so sources ``S`` and ``T·S`` (``T`` any rotation and scale) get the same matched
    weights, up to floating point and ``tol``.

    Args:
        ma: (..., dh, dh) ``A* A^T``.
        mb: (..., dh, dh) ``B* B^T``.
        aa: (..., blocks) ``|A|²`` per scale block (1 per head, dh/2 with RoPE).
        bb: (..., blocks) ``|B|²`` per scale block.
        rope: Restrict ``R`` to RoPE-commuting rotations and scales to frequency pairs.
        grid: Grid points (0: 16, or 64 under RoPE where an evaluation is cheap).
        tol: Convergence tolerance on ``max |Δ log a|``.
        max_iter: Descent iterations at most (a warning is logged when reached).

    Returns:
        ``R`` (..., dh, dh) float64, scales (..., blocks) float64, descent iterations.
    """
    ma, mb, aa, bb = ma.double(), mb.double(), aa.double(), bb.double()
    ok = (aa > 1e-300) & (bb > 1e-300)
    c = torch.where(ok, (bb / aa.clamp_min(1e-300)) ** 0.25, torch.ones_like(aa))  # balanced scale
    m = torch.where(ok, (aa * bb).sqrt(), torch.ones_like(aa))  # |c A|² = |B / c|²
    # balanced cross matrices: c Ma, Mb / c (per scale block)
    if rope:
        va, vb = _pair_vectors(ma) * c[..., None], _pair_vectors(mb) / c[..., None]
    else:
        va, vb = ma * c[..., None], mb / c[..., None]
    one = torch.ones_like(aa)
    ka = _best_score(va, torch.zeros_like(vb), one, rope)
    kb = _best_score(torch.zeros_like(va), vb, one, rope)
    k0 = _best_score(va, vb, one, rope)

    def side(k1: torch.Tensor, k2: torch.Tensor) -> torch.Tensor:
        # m x² − 2 k1 x <= 2m − 2 k0 + 2 k2 for the minimiser at x = e^{±u} >= 1
        cc = (2 * m - 2 * k0 + 2 * k2).clamp_min(0)
        return torch.log((k1 + (k1 * k1 + m * cc).sqrt()) / m).clamp_min(0)

    u_hi, u_lo = side(ka, kb), -side(kb, ka)
    n = grid or (64 if rope else 16)
    best_h = torch.full_like(aa, float("inf"))
    best_u = torch.zeros_like(aa)
    for i in range(n):
        u = u_lo + (u_hi - u_lo) * (i / max(n - 1, 1))
        x = u.exp()
        h = m * (x * x + 1 / (x * x)) - 2 * _best_score(va, vb, x, rope)
        better = h < best_h
        best_h, best_u = torch.where(better, h, best_h), torch.where(better, u, best_u)
    a = c * best_u.exp()
    it, delta = 0, float("inf")
    while it < max_iter and delta >= tol:
        it += 1
        r = _rotation(ma, mb, a, rope)
        ab, bab = _cross_terms(r, ma, mb, rope)
        new = solve_scale(aa, ab, bb, bab)
        delta = float((new.log() - a.log()).abs().max()) if new.numel() else 0.0
        a = new
    if delta >= tol:
        log.warning("joint rotation / scale: no convergence in %d iterations (max |Δ log a| = %.3g)", it, delta)
    else:
        log.debug("joint rotation / scale: converged in %d iterations", it)
    return _rotation(ma, mb, a, rope), a, it


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
