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
   ``x_i -> j`` per candidate ``(i, j)``, which has no negative cycle because ``x`` is sparse-optimal. Relaxation
   (Bellman-Ford from all-zero potentials, vectorised) finds them. Then every dense entry is checked; entries with
   a negative reduced cost ``C[i, j] - u_i - v_j`` join the candidates and the round repeats.

If no certificate comes within ``max_rounds`` (or the candidates admit no full matching, or relaxation does not
settle), the caller falls back to the dense solver. The optimum is exact up to float64 rounding of the reduced
costs: a certified ``x`` is within ``n * tol`` of the optimum, ``tol = 1e-12 * max |C|``.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import min_weight_full_bipartite_matching

log = logging.getLogger(__name__)


def _candidates(cost: torch.Tensor, k: int, chunk: int) -> torch.Tensor:
    """Flat indices ``i * n + j`` (sorted, unique) of the ``k`` smallest reduced entries per row and per column."""
    n = cost.shape[0]
    col_min = cost.amin(0)  # (n,)
    buf = torch.empty(min(chunk, n), n, dtype=cost.dtype)
    rows_k = torch.empty(n, k, dtype=torch.long)
    row_min = torch.empty(n, dtype=cost.dtype)
    for i in range(0, n, chunk):  # column reduction, then each row's k smallest and its minimum
        blk = torch.sub(cost[i : i + chunk], col_min, out=buf[: min(chunk, n - i)])
        rows_k[i : i + chunk] = torch.topk(blk, k, dim=1, largest=False, sorted=False).indices
        row_min[i : i + chunk] = blk.amin(1)
    cols_k = torch.empty(n, k, dtype=torch.long)
    for j in range(0, n, chunk):  # row reduction; columns read transposed into a contiguous buffer
        blk = torch.sub(cost[:, j : j + chunk].T, row_min, out=buf[: min(chunk, n - j)])
        cols_k[j : j + chunk] = torch.topk(blk, k, dim=1, largest=False, sorted=False).indices
    ar = torch.arange(n)[:, None]
    flat = torch.cat([(ar * n + rows_k).reshape(-1), (cols_k * n + ar).reshape(-1)])
    return torch.unique(flat)


def _solve_sparse(cost: torch.Tensor, keys: torch.Tensor) -> torch.Tensor | None:
    """Exact optimum ``x`` (row i -> column x[i]) of the problem restricted to ``keys``; None if none is full."""
    n = cost.shape[0]
    rows, cols = keys // n, keys % n
    w = cost.reshape(-1)[keys].double().numpy()
    # LAPJVsp needs non-zero weights: a constant shift changes every full matching's cost by the same n * shift
    mat = csr_matrix((w - w.min() + 1.0, (rows.numpy(), cols.numpy())), shape=(n, n))
    try:
        _, x = min_weight_full_bipartite_matching(mat)
    except ValueError:
        return None
    return torch.from_numpy(np.ascontiguousarray(x)).long()


def _potentials(
    cost: torch.Tensor, keys: torch.Tensor, x: torch.Tensor, max_iter: int, start: torch.Tensor | None = None
) -> torch.Tensor | None:
    """Column potentials ``v`` with ``v_j <= v_{x_i} + C[i, j] - C[i, x_i]`` on every candidate (or None).

    Relaxation only lowers potentials and stops at a fixed point, from any finite ``start`` (default zeros):
    a previous round's potentials make a good start.
    """
    n = cost.shape[0]
    rows, cols = keys // n, keys % n
    flat = cost.reshape(-1)
    at_x = flat[torch.arange(n) * n + x].double()  # (n,) C[i, x_i]
    src = x[rows]
    weight = flat[keys].double() - at_x[rows]
    d = torch.zeros(n, dtype=torch.float64) if start is None else start.clone()
    for _ in range(max_iter):
        new = d.scatter_reduce(0, cols, d[src] + weight, "amin", include_self=True)
        if torch.equal(new, d):
            return d
        d = new
    return None


def _violations(
    cost: torch.Tensor, u: torch.Tensor, v: torch.Tensor, tol: float, chunk: int, margin: float = 1e-4
) -> torch.Tensor:
    """Flat indices of entries with reduced cost ``C[i, j] - u_i - v_j < -tol`` (float64 on a float32 screen)."""
    n = cost.shape[0]
    out = []
    u32, v32 = u.float(), v.float()
    scale = float(u.abs().max() + v.abs().max()) + 1.0
    for i in range(0, n, chunk):
        blk = cost[i : i + chunk]
        # float32 screen: its rounding (< 1e-6 * scale) is far inside ``margin * scale``
        near = ((blk - v32[None, :]) - u32[i : i + chunk, None] < margin * scale).nonzero()
        if near.numel() == 0:
            continue
        r, c = near[:, 0], near[:, 1]
        red = (blk[r, c].double() - v[c]) - u[i + r]
        bad = red < -tol
        out.append((i + r[bad]) * n + c[bad])
    return torch.cat(out) if out else torch.empty(0, dtype=torch.long)


def certified_sparse_assignment(
    cost: torch.Tensor, k: int = 32, max_rounds: int = 4, chunk: int = 1024, max_iter: int | None = None
) -> torch.Tensor | None:
    """Optimal ``x`` minimising ``sum_i cost[i, x[i]]`` from a sparse solve, certified by duality (see module doc).

    Args:
        cost: (n, n) float32 or float64 (not modified).
        k: Candidates per row and per column.
        max_rounds: Sparse solves at most (each adds the entries that broke the certificate).
        chunk: Rows / columns per block of the dense passes (bounds temporaries to ``chunk x n``).
        max_iter: Relaxation sweeps at most (default ``n``; more would mean a negative cycle: rounding on ties).

    Returns:
        ``x`` (n,) int64 (row ``i`` takes column ``x[i]``), or None when no certificate was reached.
    """
    n = cost.shape[0]
    k = min(k, n)
    tol = 1e-12 * float(cost.abs().max())
    keys = _candidates(cost, k, chunk)
    v = None
    for rnd in range(max_rounds):
        x = _solve_sparse(cost, keys)
        if x is None:
            return None
        v = _potentials(cost, keys, x, max_iter or n, start=v)
        if v is None:
            return None
        u = cost.reshape(-1)[torch.arange(n) * n + x].double() - v[x]
        bad = _violations(cost, u, v, tol, chunk)
        bad = bad[~torch.isin(bad, keys)]  # candidates are settled by the sparse solve (rounding only)
        log.debug("certified assignment: round %d, %d candidates, %d violations", rnd, keys.numel(), bad.numel())
        if bad.numel() == 0:
            return x
        keys = torch.unique(torch.cat([keys, bad]))
    return None
