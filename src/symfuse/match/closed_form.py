"""Closed-form solvers: orthogonal Procrustes (dense and RoPE-restricted), quartic scaling, assignment.

Notation: for one KV group, ``A`` (dh, n) is the source's stacked query-side columns and ``B`` (dh, m) its
key-side columns (or value-side / output-side for VO), ``A*`` / ``B*`` the anchor's. Cross matrices
``Ma = A* A^T`` and ``Mb = B* B^T`` (dh, dh) are all a solver needs besides norms: the rotation ``R`` maximises
``tr(R^T (Ma + Mb))`` (minimising ``||R [A|B] - [A*|B*]||``), and the scale ``a`` minimises
``||a R A - A*||² + ||R B / a - B*||²``.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment

from symfuse.match.assignment import certified_sparse_assignment
from symfuse.match.joint import joint_rotation_scale
from symfuse.match.rope_pairs import pair_vectors, rope_rotation
from symfuse.runtime import torch_threads

log = logging.getLogger(__name__)


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
    return rope_rotation(pair_vectors(m.to(torch.float64)))


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
    minimiser of :func:`~symfuse.match.joint.joint_rotation_scale`, which depends only on the source's orbit under
    rotations and scales
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
            r = torch.eye(dh, dtype=torch.float64, device=ma.device).expand_as(ma)
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
    sim = sim.cpu()  # the assignment runs on the CPU (a copy when ``sim`` lives on a device)
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
