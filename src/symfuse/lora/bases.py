"""The three ways to merge one module's K LoRA updates with a registered strategy, and the re-factoring to rank R.

Adapter ``i``'s update of a module is ``D_i = s_i B_i A_i`` (``(out, in)``). ``B_i M, M^-1 A_i`` give the same
``D_i`` for any invertible ``M`` (the GL(r) symmetry of a factorisation), so a merge that depends on the factors
and not on the ``D_i`` depends on an arbitrary basis.

* ``naive`` (PEFT's ``add_weighted_adapter`` for its non-SVD types): the strategy merges the ``sqrt(s_i) B_i`` and,
  separately, the ``sqrt(s_i) A_i``; ``D = B A``. Basis-dependent; needs one rank. Kept for comparison.
* ``aligned`` (KnOTS, Stoica et al., ICLR 2025): the SVD of the concatenation ``[D_1, ..., D_K] = U S [V_1^T, ...,
  V_K^T]`` gives every update in one shared basis, ``D_i = U S V_i^T``; the strategy merges the ``V_i^T``
  (``(q, in)``, ``q`` the concatenation's rank) and ``D = U S V^T``. It depends on the ``D_i`` only (the SVD's
  signs are fixed: the largest entry of each column of ``U`` is positive).
* ``full``: the strategy merges the ``D_i`` themselves (task vectors against a zero base); ``D`` is then
  re-factored by truncated SVD. Depends on the ``D_i`` only.

Strategies see float64 tensors as task vectors: a strategy that works on task vectors (``needs_base`` or
``accepts_base``) gets a zero base, any other the tensors themselves. With a linear strategy (``simple``,
``task-arithmetic``) the three agree with ``sum_i c_i D_i`` when the ranks allow; they differ for the
non-linear ones (TIES's trimming and sign election act on entries, and entries depend on the basis).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from symfuse.merge.base import Merger, TensorInputs

BASES = ("aligned", "full", "naive")
F64 = torch.float64


def combine(merger: Merger, name: str, xs: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """``merger`` applied to the K float64 tensors ``xs`` (a zero base for task-vector strategies)."""
    xs = [x.to(F64) for x in xs]
    base = torch.zeros_like(xs[0]) if (merger.needs_base or merger.accepts_base) else None
    return merger.merge_tensor(TensorInputs(name, xs, list(weights), base)).to(F64)


def _fix_signs(u: torch.Tensor, *rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Flip singular pairs so that the largest-magnitude entry of each column of ``u`` is positive."""
    if u.shape[1] == 0:
        return (u, *rows)
    idx = u.abs().argmax(dim=0)
    sign = torch.sign(u[idx, torch.arange(u.shape[1], device=u.device)])
    sign[sign == 0] = 1
    return (u * sign, *(r * sign[:, None] for r in rows))


def shared_basis(
    bs: Sequence[torch.Tensor], as_: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """``U, S, [V_i^T]`` with ``B_i A_i = U diag(S) V_i^T`` for every ``i`` (KnOTS's shared basis).

    Computed from the factors (QR of ``[B_1 ... B_K]``, then the SVD of a ``(q0, K in)`` matrix), never from the
    ``(out, K in)`` concatenation; singular values below ``max(shape) * eps * S_max`` are dropped.

    Args:
        bs: K ``(out, r_i)`` left factors (scales folded in; rank 0 allowed).
        as_: K ``(r_i, in)`` right factors.

    Returns:
        ``U`` ``(out, q)`` orthonormal, ``S`` ``(q,)``, K matrices ``V_i^T`` ``(q, in)``.
    """
    n_in = as_[0].shape[1]
    q_mat, r_mat = torch.linalg.qr(torch.cat([b.to(F64) for b in bs], dim=1))
    cols = torch.cumsum(torch.tensor([0, *(b.shape[1] for b in bs)]), 0).tolist()
    m = torch.cat([r_mat[:, cols[i] : cols[i + 1]] @ a.to(F64) for i, a in enumerate(as_)], dim=1)
    p, s, wt = torch.linalg.svd(m, full_matrices=False)
    tol = max(m.shape) * torch.finfo(F64).eps * (float(s[0]) if s.numel() else 0.0)
    keep = s > tol
    u, wt = _fix_signs(q_mat @ p[:, keep], wt[keep])
    return u, s[keep], [wt[:, i * n_in : (i + 1) * n_in] for i in range(len(as_))]


def merge_aligned(
    merger: Merger, name: str, bs: Sequence[torch.Tensor], as_: Sequence[torch.Tensor], weights: Sequence[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """KnOTS: ``(U, S V^T)`` with ``V^T`` the strategy's merge of the ``V_i^T`` of :func:`shared_basis`."""
    u, s, vts = shared_basis(bs, as_)
    if s.numel() == 0:  # every update is zero
        return u, torch.zeros(0, as_[0].shape[1], dtype=F64, device=u.device)
    return u, s[:, None] * combine(merger, f"{name}.V", vts, weights)


def merge_full(
    merger: Merger, name: str, bs: Sequence[torch.Tensor], as_: Sequence[torch.Tensor], weights: Sequence[float]
) -> tuple[None, torch.Tensor]:
    """``(None, D)`` with ``D`` the strategy's merge of the full updates ``B_i A_i``."""
    deltas = [b.to(F64) @ a.to(F64) for b, a in zip(bs, as_, strict=True)]
    return None, combine(merger, f"{name}.weight", deltas, weights)


def merge_naive(
    merger: Merger, name: str, bs: Sequence[torch.Tensor], as_: Sequence[torch.Tensor], weights: Sequence[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Q, R A)`` with ``Q R = B``: ``B`` and ``A`` the strategy's merges of the ``B_i`` and of the ``A_i``.

    ``bs`` / ``as_`` must carry ``sqrt(s_i)`` each (the caller splits the scale), and share one rank.
    """
    b = combine(merger, f"{name}.lora_B", bs, weights)
    a = combine(merger, f"{name}.lora_A", as_, weights)
    q_mat, r_mat = torch.linalg.qr(b)
    return q_mat, r_mat @ a


def low_rank(left: torch.Tensor | None, core: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``B (out, rank), A (rank, in)`` with ``B A`` the best rank-``rank`` approximation of ``left @ core``.

    ``left`` has orthonormal columns (None: the identity). The singular values are split evenly between the
    factors (``B = U sqrt(S)``, ``A = sqrt(S) V^T``); missing ranks are zero columns / rows.

    Returns:
        ``(B, A, error)``: ``error = ||D - B A||_F / ||D||_F`` (0 for ``D = 0``), what the truncation lost.
    """
    p, s, vt = torch.linalg.svd(core, full_matrices=False)
    u = left @ p if left is not None else p
    u, vt = _fix_signs(u, vt)
    k = min(rank, s.numel())
    root = s[:k].sqrt()
    b = torch.zeros(u.shape[0], rank, dtype=F64, device=u.device)
    a = torch.zeros(rank, vt.shape[1], dtype=F64, device=u.device)
    b[:, :k] = u[:, :k] * root
    a[:k] = root[:, None] * vt[:k]
    total = float(s.square().sum())
    error = (float(s[k:].square().sum()) / total) ** 0.5 if total > 0 else 0.0
    return b, a, error
