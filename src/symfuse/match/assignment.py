"""Exact linear assignment of a big dense cost matrix: a sparse solve, certified by LP duality.

Minimise ``sum_i C[i, x_i]`` over permutations ``x``. The dense Hungarian / Jonker-Volgenant solvers take seconds
at n = 3072 (and hold the GIL); but the optimum of an unstructured problem uses few, cheap entries of each row
and column. So:

1. Candidates: after column then row reduction (``C - min_i C - min_j (...)``, which leaves the optimum unchanged),
   keep the ``k`` smallest entries of every row and of every column.
2. Solve the SPARSE problem exactly (scipy's LAPJVsp, :func:`scipy.sparse.csgraph.min_weight_full_bipartite_matching`).
3. Certificate. ``x`` is optimal for the DENSE problem iff duals ``u, v`` exist with ``u_i + v_j <= C[i, j]``
   everywhere and equality on ``x`` (LP duality: any permutation ``y`` then costs
   ``sum_i C[i, y_i] >= sum_i u_i + v_{y_i} = sum_i C[i, x_i]``). Take ``u_i = C[i, x_i] - v_{x_i}``; the
   sparse constraints read ``v_j <= v_{x_i} + C[i, j] - C[i, x_i]``: potentials of the graph with an edge
   ``x_i -> j`` per candidate ``(i, j)``, which has no negative cycle because ``x`` is sparse-optimal. Shortest-path
   relaxation finds them (from the previous round's potentials). Then every dense entry is checked; entries with
   a negative reduced cost ``C[i, j] - u_i - v_j`` join the candidates and the round repeats.

Steps 1 and 3 run through :mod:`symfuse.native` (compiled kernels for contiguous float32 CPU costs, its torch
versions for any other): both find the same optimum. After violating entries join the candidates, ``x`` may still
be optimal on the grown graph (no negative cycle through the new edges): relaxing on from the last potentials
settles then, and the dense check runs again over the rows whose ``u_i`` grew; a negative cycle, or more
relaxations than twice the edges, sends the solve back to step 2.

If no certificate comes within ``max_rounds`` (or the candidates admit no full matching, or relaxation does not
settle), the caller falls back to the dense solver. The optimum is exact up to float64 rounding of the reduced
costs: a certified ``x`` is within ``n * tol`` of the optimum, ``tol = 1e-12 * max |C|``.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import min_weight_full_bipartite_matching

from symfuse import native

log = logging.getLogger(__name__)


def _flat(rows_k: torch.Tensor, cols_k: torch.Tensor) -> torch.Tensor:
    """Sorted unique flat indices ``i * n + j`` of per-row columns (n, k) and per-column rows (n, k)."""
    n = rows_k.shape[0]
    ar = torch.arange(n)[:, None]
    return torch.unique(torch.cat([(ar * n + rows_k).reshape(-1), (cols_k * n + ar).reshape(-1)]))


def _csr(keys: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(indptr (n + 1,), columns) of sorted flat ``keys``."""
    indptr = torch.zeros(n + 1, dtype=torch.long)
    indptr[1:] = torch.bincount(keys // n, minlength=n).cumsum(0)
    return indptr, keys % n


def _solve_sparse(cost: torch.Tensor, keys: torch.Tensor) -> torch.Tensor | None:
    """Exact optimum ``x`` (row i -> column x[i]) of the problem restricted to ``keys``; None if none is full."""
    n = cost.shape[0]
    indptr, cols = _csr(keys, n)
    w = cost.reshape(-1)[keys].double().numpy()
    # LAPJVsp needs non-zero weights: a constant shift changes every full matching's cost by the same n * shift
    mat = csr_matrix((w - w.min() + 1.0, cols.numpy(), indptr.numpy()), shape=(n, n))
    try:
        _, x = min_weight_full_bipartite_matching(mat)
    except ValueError:
        return None
    return torch.from_numpy(np.ascontiguousarray(x)).long()


def certified_sparse_assignment(cost: torch.Tensor, k: int = 32, max_rounds: int = 4) -> torch.Tensor | None:
    """Optimal ``x`` minimising ``sum_i cost[i, x[i]]`` from a sparse solve, certified by duality (see module doc).

    Args:
        cost: (n, n) float costs (not modified).
        k: Candidates per row and per column.
        max_rounds: Sparse solves at most (each adds the entries that broke the certificate).

    Returns:
        ``x`` (n,) int64 (row ``i`` takes column ``x[i]``), or None when no certificate was reached.
    """
    n = cost.shape[0]
    rows_k, cols_k, abs_max = native.candidates(cost, min(k, n))
    if not math.isfinite(abs_max):
        return None  # NaN / inf: the dense solver reports it
    keys = _flat(rows_k, cols_k)
    tol = 1e-12 * abs_max
    v = torch.zeros(n, dtype=torch.float64)
    for rnd in range(max_rounds):
        x = _solve_sparse(cost, keys)
        if x is None:
            return None
        keys, certified = _certify(cost, keys, x, v, tol)
        log.debug("certified assignment: round %d, %d candidates, certified %s", rnd, keys.numel(), certified)
        if certified is None:
            return None
        if certified:
            return x
    return None


def _grow(keys: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    """Sorted ``keys`` with the violating entries ``bad`` added (sorted, unique); ``keys`` itself if none is new."""
    if bad.numel() == 0:
        return keys
    pos = torch.searchsorted(keys, bad)
    # a candidate reported here is rounding only (the sparse solve settled it): keep the others
    new = torch.unique(bad[keys[pos.clamp(max=keys.numel() - 1)] != bad])
    if new.numel() == 0:
        return keys
    # merge two sorted lists: each new key lands after the old keys below it and the new keys before it
    at = torch.searchsorted(keys, new) + torch.arange(new.numel())
    out = torch.empty(keys.numel() + new.numel(), dtype=keys.dtype)
    old = torch.ones(out.numel(), dtype=torch.bool)
    old[at] = False
    out[at], out[old] = new, keys
    return out


def _certify(
    cost: torch.Tensor, keys: torch.Tensor, x: torch.Tensor, v: torch.Tensor, tol: float, passes: int = 4
) -> tuple[torch.Tensor, bool | None]:
    """(grown candidates, whether ``x`` is certified; None: rounding on ties, no certificate). Updates ``v``."""
    n = cost.shape[0]
    budget = 2**62  # the first relaxation (after a solve) has no cycle: x is optimal on its own candidates
    rows = None  # rows to check: all, then those whose u_i = C[i, x_i] - v_{x_i} grew (v only ever decreases,
    for _ in range(passes):  # and a lower v_j only raises reduced costs in column j)
        indptr, cols = _csr(keys, n)
        before = v.clone()
        status = native.potentials(cost, indptr, cols, x, v, tol, budget)
        if status == native.NEGATIVE_CYCLE and budget == 2**62:
            return keys, None
        if status != native.SETTLED:
            return keys, False
        if rows is not None:
            rows = (v[x] != before[x]).nonzero().squeeze(1)
        bad, count = native.violations(cost, x, v, tol, cap=4 * n, rows=rows)
        grown = _grow(keys, bad)
        if grown is keys and count == bad.numel():
            return keys, True
        # over the cap, some violations went unreported: check every row next time
        rows = torch.empty(0, dtype=torch.long) if count == bad.numel() else None
        keys, budget = grown, 2 * grown.numel()
    return keys, False
