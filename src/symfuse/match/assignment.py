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

Two kernel sets compute steps 1 and 3: compiled C (:mod:`symfuse.match.lapcore`: heaps filled in one pass over
the rows, a label-correcting queue, one float64 pass; 2-4x faster) for contiguous float32 costs, and torch
(any float dtype; blocked top-k, vectorised Bellman-Ford sweeps, a float32 row-minimum screen). Both find the
same optimum.

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

from symfuse.match import lapcore

log = logging.getLogger(__name__)


def _flat(rows_k: torch.Tensor, cols_k: torch.Tensor) -> torch.Tensor:
    """Sorted unique flat indices ``i * n + j`` of per-row columns (n, k) and per-column rows (n, k)."""
    n = rows_k.shape[0]
    ar = torch.arange(n)[:, None]
    return torch.unique(torch.cat([(ar * n + rows_k).reshape(-1), (cols_k * n + ar).reshape(-1)]))


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
    for j in range(0, n, chunk):  # row reduction; columns copied transposed into a contiguous buffer
        blk = buf[: min(chunk, n - j)]
        blk.copy_(cost[:, j : j + chunk].T).sub_(row_min)
        cols_k[j : j + chunk] = torch.topk(blk, k, dim=1, largest=False, sorted=False).indices
    return _flat(rows_k, cols_k)


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


def _edge_weights(cost: torch.Tensor, keys: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``C[i, j] - C[i, x_i]`` (float64) of each candidate ``(i, j)``: the weight of the edge ``x_i -> j``."""
    n = cost.shape[0]
    flat = cost.reshape(-1)
    at_x = flat[torch.arange(n) * n + x].double()  # (n,) C[i, x_i]
    return flat[keys].double() - at_x[keys // n]


def _potentials(
    cost: torch.Tensor, keys: torch.Tensor, x: torch.Tensor, start: torch.Tensor, max_iter: int
) -> torch.Tensor | None:
    """Column potentials ``v`` with ``v_j <= v_{x_i} + C[i, j] - C[i, x_i]`` on every candidate (or None).

    Vectorised Bellman-Ford sweeps. Relaxation only lowers potentials and stops at a fixed point, from any
    finite ``start``: a previous round's potentials make a good start.
    """
    n = cost.shape[0]
    src, cols = x[keys // n], keys % n
    weight = _edge_weights(cost, keys, x)
    d = start.clone()
    for _ in range(max_iter):
        new = d.scatter_reduce(0, cols, d[src] + weight, "amin", include_self=True)
        if torch.equal(new, d):
            return d
        d = new
    return None


def _violations(
    cost: torch.Tensor, x: torch.Tensor, v: torch.Tensor, tol: float, chunk: int, margin: float = 1e-4
) -> torch.Tensor:
    """Flat indices of entries with reduced cost ``C[i, j] - u_i - v_j < -tol``, ``u_i = C[i, x_i] - v_{x_i}``.

    A screen in ``cost``'s dtype (each row's smallest ``C[i, j] - v_j`` off ``x_i``) picks the rows that can hold
    one; only those are checked in float64. A float32 screen's rounding (< 1e-6 * scale) is far inside
    ``margin * scale``.
    """
    n = cost.shape[0]
    u = cost.reshape(-1)[torch.arange(n) * n + x].double() - v[x]
    v_low, u_low = v.to(cost.dtype), u.to(cost.dtype)
    scale = float(u.abs().max() + v.abs().max()) + 1.0
    slack = margin * scale if cost.dtype != torch.float64 else tol
    buf = torch.empty(min(chunk, n), n, dtype=cost.dtype)
    out = []
    for i in range(0, n, chunk):
        m = min(chunk, n - i)
        blk = torch.sub(cost[i : i + m], v_low, out=buf[:m])
        blk[torch.arange(m), x[i : i + m]] = torch.inf  # the tight entry of each row
        rows = i + ((blk.amin(1) - u_low[i : i + m]) < slack).nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        red = (cost[rows].double() - v) - u[rows, None]
        r, c = (red < -tol).nonzero().unbind(1)
        out.append(rows[r] * n + c)
    return torch.cat(out) if out else torch.empty(0, dtype=torch.long)


def _native_ok(cost: torch.Tensor, native: bool | None) -> bool:
    usable = lapcore.LIB is not None and cost.dtype == torch.float32 and cost.is_contiguous()
    if native and not usable:
        raise ValueError("native assignment kernels need the compiled _lapcore and a contiguous float32 cost")
    return usable if native is None else native


def certified_sparse_assignment(
    cost: torch.Tensor,
    k: int = 32,
    max_rounds: int = 4,
    chunk: int = 1024,
    max_iter: int | None = None,
    native: bool | None = None,
) -> torch.Tensor | None:
    """Optimal ``x`` minimising ``sum_i cost[i, x[i]]`` from a sparse solve, certified by duality (see module doc).

    Args:
        cost: (n, n) float32 or float64 (not modified).
        k: Candidates per row and per column.
        max_rounds: Sparse solves at most (each adds the entries that broke the certificate).
        chunk: Rows / columns per block of the torch kernels (bounds temporaries to ``chunk x n``).
        max_iter: Bellman-Ford sweeps at most in the torch kernels (default ``n``; more would mean a negative
            cycle: rounding on ties).
        native: Use the compiled kernels (None: when built and ``cost`` is contiguous float32).

    Returns:
        ``x`` (n,) int64 (row ``i`` takes column ``x[i]``), or None when no certificate was reached.
    """
    n = cost.shape[0]
    k = min(k, n)
    native = _native_ok(cost, native)
    if native:
        rows_k, cols_k, abs_max = lapcore.candidates(cost, k)
        if not math.isfinite(abs_max):
            return None  # NaN / inf: the dense solver reports it
        keys = _flat(rows_k, cols_k)
    else:
        if not bool(torch.isfinite(cost).all()):
            return None
        lo, hi = torch.aminmax(cost)
        keys, abs_max = _candidates(cost, k, chunk), max(float(hi), -float(lo))
    tol = 1e-12 * abs_max
    v = torch.zeros(n, dtype=torch.float64)
    for rnd in range(max_rounds):
        x = _solve_sparse(cost, keys)
        if x is None:
            return None
        if native:
            keys, certified = _certify_native(cost, keys, x, v, tol)
        else:
            keys, certified = _certify_torch(cost, keys, x, v, tol, chunk, max_iter or n)
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


def _certify_torch(
    cost: torch.Tensor, keys: torch.Tensor, x: torch.Tensor, v: torch.Tensor, tol: float, chunk: int, max_iter: int
) -> tuple[torch.Tensor, bool | None]:
    """(grown candidates, whether ``x`` is certified; None: relaxation did not settle). Updates ``v`` in place."""
    d = _potentials(cost, keys, x, v, max_iter)
    if d is None:
        return keys, None
    v.copy_(d)
    grown = _grow(keys, _violations(cost, x, v, tol, chunk))
    return grown, grown is keys


def _certify_native(
    cost: torch.Tensor, keys: torch.Tensor, x: torch.Tensor, v: torch.Tensor, tol: float, passes: int = 4
) -> tuple[torch.Tensor, bool | None]:
    """Like :func:`_certify_torch`, with the compiled kernels and without re-solving when it can be avoided.

    After violating entries join the candidates, ``x`` may still be optimal on the grown graph (no negative
    cycle through the new edges): relaxing on from ``v`` settles then, and the dense check runs again. A
    negative cycle, or more relaxations than twice the edges, sends the caller back to the sparse solve.
    """
    n = cost.shape[0]
    budget = 2**62  # the first relaxation (after a solve) has no cycle: x is optimal on its own candidates
    rows = None  # rows to check: all, then those whose u_i = C[i, x_i] - v_{x_i} grew (v only ever decreases,
    for _ in range(passes):  # and a lower v_j only raises reduced costs in column j)
        indptr, cols = _csr(keys, n)
        before = v.clone()
        status = lapcore.potentials(cost, indptr, cols, x, v, tol, budget)
        if status == lapcore.NEGATIVE_CYCLE and budget == 2**62:
            return keys, None  # rounding on ties: no certificate
        if status != lapcore.SETTLED:
            return keys, False
        if rows is not None:
            rows = (v[x] != before[x]).nonzero().squeeze(1)
        bad, count = lapcore.violations(cost, x, v, tol, cap=4 * n, rows=rows)
        grown = _grow(keys, bad)
        if grown is keys and count == bad.numel():
            return keys, True
        # over the cap, some violations went unreported: check every row next time
        rows = torch.empty(0, dtype=torch.long) if count == bad.numel() else None
        keys, budget = grown, 2 * grown.numel()
    return keys, False
