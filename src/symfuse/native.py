"""Platform code: the compiled kernels of the FFN assignment, each behind one function with a plain-torch fallback.

The kernels are plain C (``symfuse/match/_lapcore.c``, built by ``pip install`` as ``symfuse.match._lapcore``;
optional: without a compiler the install goes on) loaded with ctypes, which releases the GIL for the call, so
matching threads run them in parallel. Each function below runs its kernel when the library is built and the
inputs suit it (contiguous float32 CPU tensors: the C side trusts the checks made here), and otherwise its torch
version, which gives the same result for any float dtype and device (``tests/symfuse/test_native.py`` holds each
pair to each other). On the roberta-base FFN problem (n = 3072, two independently initialised models) the kernels
make the certified assignment about 3x faster than the torch versions run single-threaded, as matching workers run
them, on a 2-core AMD EPYC (``bench/results/retired.md``; 20x scipy's dense solver there).
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_P, _I, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
SETTLED, NEGATIVE_CYCLE, OVER_BUDGET = 0, 1, 2  # potentials' outcomes


def _load() -> ctypes.CDLL | None:
    here = Path(__file__).parent / "match"
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / f"_lapcore{suffix}"
        if path.exists():
            try:
                lib = ctypes.CDLL(str(path))
            except OSError as e:  # wrong platform / corrupt build: the torch versions still work
                log.warning("%s: cannot load (%s); using the slower torch assignment kernels", path, e)
                return None
            lib.symfuse_candidates.argtypes = [_P, _I, _I, _P, _P, _P]
            lib.symfuse_candidates.restype = ctypes.c_int
            lib.symfuse_potentials.argtypes = [_P, _I, _P, _P, _P, _P, _D, _I]
            lib.symfuse_potentials.restype = ctypes.c_int
            lib.symfuse_violations.argtypes = [_P, _I, _P, _P, _D, _P, _I, _P, _I]
            lib.symfuse_violations.restype = _I
            lib.symfuse_sqdist_columns.argtypes = [_P, _I, _P, _I, _I, _I, _P, _P]
            lib.symfuse_sqdist_columns.restype = None
            lib.symfuse_row_two_smallest.argtypes = [_P, _I, _I, _P, _P]
            lib.symfuse_row_two_smallest.restype = None
            return lib
    log.info("compiled assignment kernels not built; using the slower torch kernels")
    return None


LIB = _load()


def _compiled(*tensors: torch.Tensor) -> bool:
    """Whether the kernel can take these tensors: built, float32 on the CPU, rows contiguous."""
    return LIB is not None and all(
        t.dtype == torch.float32 and t.device.type == "cpu" and (t.dim() < 2 or t.stride(-1) == 1) for t in tensors
    )


def _square(cost: torch.Tensor) -> int:
    if cost.dim() != 2 or cost.shape[0] != cost.shape[1]:
        raise ValueError(f"cost must be square, got shape {tuple(cost.shape)}")
    return cost.shape[0]


def _check_range(idx: torch.Tensor, n: int, what: str) -> None:
    """Indices the C side will dereference must lie in ``0..n-1``."""
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
        raise ValueError(f"{what} must lie in 0..{n - 1}")


def candidates(cost: torch.Tensor, k: int, chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Each row's ``k`` smallest column-reduced entries and each column's ``k`` smallest row-reduced ones.

    Args:
        cost: (n, n) float costs.
        k: Entries per row and per column (``1 <= k <= n``).
        chunk: Rows / columns per block of the torch version (bounds its temporaries to ``chunk x n``).

    Returns:
        ``(rows_k, cols_k, abs_max)``: (n, k) columns of each row's entries, (n, k) rows of each column's, and
        max |C|; ``abs_max`` is infinite when ``cost`` holds NaN or inf (the index tensors are then meaningless).
    """
    n = _square(cost)
    if not 1 <= k <= n or n >= 2**31:
        raise ValueError(f"k must be in 1..{n} (and n < 2**31), got k={k}")
    rows_k = torch.empty(n, k, dtype=torch.long, device=cost.device)
    cols_k = torch.empty(n, k, dtype=torch.long, device=cost.device)
    if _compiled(cost) and cost.is_contiguous():
        abs_max = ctypes.c_float()
        if LIB.symfuse_candidates(cost.data_ptr(), n, k, rows_k.data_ptr(), cols_k.data_ptr(), ctypes.byref(abs_max)):
            raise MemoryError(f"assignment candidates: no memory for {n} x {k} heaps")
        return rows_k, cols_k, abs_max.value
    if not bool(torch.isfinite(cost).all()):
        return rows_k, cols_k, float("inf")
    lo, hi = torch.aminmax(cost)
    col_min = cost.amin(0)  # (n,)
    buf = torch.empty(min(chunk, n), n, dtype=cost.dtype, device=cost.device)
    row_min = torch.empty(n, dtype=cost.dtype, device=cost.device)
    for i in range(0, n, chunk):  # column reduction, then each row's k smallest and its minimum
        blk = torch.sub(cost[i : i + chunk], col_min, out=buf[: min(chunk, n - i)])
        rows_k[i : i + chunk] = torch.topk(blk, k, dim=1, largest=False, sorted=False).indices
        row_min[i : i + chunk] = blk.amin(1)
    for j in range(0, n, chunk):  # row reduction; columns copied transposed into a contiguous buffer
        blk = buf[: min(chunk, n - j)]
        blk.copy_(cost[:, j : j + chunk].T).sub_(row_min)
        cols_k[j : j + chunk] = torch.topk(blk, k, dim=1, largest=False, sorted=False).indices
    return rows_k, cols_k, max(float(hi), -float(lo))


def potentials(
    cost: torch.Tensor,
    indptr: torch.Tensor,
    cols: torch.Tensor,
    x: torch.Tensor,
    d: torch.Tensor,
    tol: float,
    max_relax: int = 2**62,
) -> int:
    """Lower ``d`` (in place) to potentials of the candidate graph: ``d_j <= d_{x_i} + C[i, j] - C[i, x_i]``.

    The kernel is a label-correcting shortest-path search (FIFO queue); the torch version relaxes every edge at
    once per sweep (Bellman-Ford). Either counts only improvements larger than ``tol``.

    Args:
        cost: (n, n) float costs.
        indptr: (n + 1,) int64 CSR row pointer of the candidates.
        cols: (m,) int64 column of each candidate, by row (each in ``0..n-1``).
        x: (n,) int64 permutation; row ``i``'s edges leave node ``x[i]``.
        d: (n,) float64 start potentials, overwritten.
        tol: Smallest improvement a relaxation counts.
        max_relax: Relaxations at most.

    Returns:
        ``SETTLED`` (``d`` is a fixed point), ``NEGATIVE_CYCLE``, or ``OVER_BUDGET`` (``d`` lowered, not settled).
    """
    n = _square(cost)
    for t in (indptr, cols, x):
        if t.dtype != torch.long or not t.is_contiguous():
            raise ValueError(f"potentials: expected contiguous int64, got {t.dtype}")
    if d.dtype != torch.float64 or not d.is_contiguous() or d.numel() != n or indptr.numel() != n + 1:
        raise ValueError("potentials: d must be contiguous float64 (n,), indptr (n + 1,)")
    if x.numel() != n or int(indptr[-1]) != cols.numel():
        raise ValueError("potentials: x must be (n,) and indptr must end at the number of candidates")
    _check_range(x, n, "potentials: x")
    _check_range(cols, n, "potentials: cols")
    if _compiled(cost) and cost.is_contiguous():
        status = LIB.symfuse_potentials(
            cost.data_ptr(), n, indptr.data_ptr(), cols.data_ptr(), x.data_ptr(), d.data_ptr(), tol, max_relax
        )
        if status < 0:
            raise MemoryError(f"assignment potentials: no memory for {n} nodes")
        return status
    rows = torch.repeat_interleave(torch.arange(n, device=cost.device), indptr.diff())  # each candidate's row
    flat = cost.reshape(-1)
    weight = flat[rows * n + cols].double() - flat[torch.arange(n, device=cost.device) * n + x].double()[rows]
    src = x[rows]
    for _ in range(n):  # a path of n edges still improving: a negative cycle
        best = d.scatter_reduce(0, cols, d[src] + weight, "amin", include_self=True)
        better = best < d - tol
        relaxed = int(better.sum())
        if relaxed == 0:
            return SETTLED
        d.copy_(torch.where(better, best, d))
        max_relax -= relaxed
        if max_relax < 0:
            return OVER_BUDGET
    return NEGATIVE_CYCLE


def violations(
    cost: torch.Tensor,
    x: torch.Tensor,
    v: torch.Tensor,
    tol: float,
    cap: int,
    rows: torch.Tensor | None = None,
    chunk: int = 1024,
) -> tuple[torch.Tensor, int]:
    """Flat indices ``i * n + j`` of (up to ``cap``) entries with ``C[i, j] - u_i - v_j < -tol``, and their count.

    ``u_i = C[i, x_i] - v_{x_i}``. Only the given ``rows`` (int64, in that order) are checked when given, else
    all; the indices come by row, then column. The torch version screens rows in ``cost``'s dtype (each row's
    smallest ``C[i, j] - v_j`` off ``x_i``, with a margin far above float32 rounding) and checks only the rows
    that can hold one in float64, in blocks of ``chunk`` rows.
    """
    n = _square(cost)
    if x.dtype != torch.long or v.dtype != torch.float64 or x.numel() != n or v.numel() != n:
        raise ValueError("violations: x must be int64 (n,), v float64 (n,)")
    x, v = x.contiguous(), v.contiguous()
    _check_range(x, n, "violations: x")
    if rows is not None:
        rows = rows.to(torch.long).contiguous()
        _check_range(rows, n, "violations: rows")
        if rows.numel() == 0:  # (an empty tensor's data pointer may be NULL, which the C side reads as "all rows")
            return torch.empty(0, dtype=torch.long, device=cost.device), 0
    if _compiled(cost) and cost.is_contiguous():
        out = torch.empty(cap, dtype=torch.long)
        count = LIB.symfuse_violations(
            cost.data_ptr(),
            n,
            x.data_ptr(),
            v.data_ptr(),
            tol,
            None if rows is None else rows.data_ptr(),
            0 if rows is None else rows.numel(),
            out.data_ptr(),
            cap,
        )
        return out[: min(count, cap)], int(count)
    which = torch.arange(n, device=cost.device) if rows is None else rows
    u = cost.reshape(-1)[torch.arange(n, device=cost.device) * n + x].double() - v[x]
    v_low, u_low = v.to(cost.dtype), u.to(cost.dtype)
    slack = 1e-4 * (float(u.abs().max() + v.abs().max()) + 1.0) if cost.dtype != torch.float64 else tol
    found = []
    for b in range(0, which.numel(), chunk):
        idx = which[b : b + chunk]
        blk = cost[idx] - v_low
        blk[torch.arange(idx.numel(), device=cost.device), x[idx]] = torch.inf  # the tight entry of each row
        hit = idx[(blk.amin(1) - u_low[idx]) < slack]
        if hit.numel():
            r, c = (((cost[hit].double() - v) - u[hit, None]) < -tol).nonzero().unbind(1)
            found.append(hit[r] * n + c)
    bad = torch.cat(found) if found else torch.empty(0, dtype=torch.long, device=cost.device)
    return bad[:cap], bad.numel()


def sqdist_columns(s: torch.Tensor, a: torch.Tensor, cols: torch.Tensor, out: torch.Tensor, chunk: int = 1 << 21):
    """``out[i] += sum_r (s[r, i] - a[r, cols[i]])²`` (float32 differences, float64 sums), in place.

    Args:
        s: (d, m) float (a column slice of a bigger matrix is fine).
        a: (d, n) float.
        cols: (m,) int64 in ``0..n-1``.
        out: (m,) float64.
        chunk: Elements per block of rows of the torch version (bounds its float32 temporaries).
    """
    (d, m), n = s.shape, a.shape[1]
    if a.shape[0] != d or cols.shape != (m,) or cols.dtype != torch.long or out.shape != (m,):
        raise ValueError(f"sqdist_columns: shapes {tuple(s.shape)}, {tuple(a.shape)}, {tuple(cols.shape)}")
    if out.dtype != torch.float64:
        raise ValueError("sqdist_columns: out must be float64")
    cols = cols.contiguous()
    _check_range(cols, n, "sqdist_columns: cols")
    if _compiled(s, a) and out.is_contiguous():  # row by row: no strided column gather
        LIB.symfuse_sqdist_columns(
            s.data_ptr(), s.stride(0), a.data_ptr(), a.stride(0), d, m, cols.data_ptr(), out.data_ptr()
        )
        return
    f32 = torch.float32
    step = max(1, chunk // max(m, 1))
    for r in range(0, d, step):
        diff = s[r : r + step].to(f32) - a[r : r + step][:, cols].to(f32)
        out += diff.square().sum(0).double()


def row_two_smallest(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of a (rows, cols >= 2) matrix: argmin (the first on ties) and the second smallest value.

    The kernel makes one pass; ``torch.topk(m, 2, largest=False)`` gives the same, about 2x slower.
    """
    if m.dim() != 2 or not 2 <= m.shape[1] < 2**31:
        raise ValueError(f"row_two_smallest: need a matrix with >= 2 columns, got {tuple(m.shape)}")
    if _compiled(m) and m.is_contiguous():
        rows, cols = m.shape
        best = torch.empty(rows, dtype=torch.long)
        second = torch.empty(rows, dtype=torch.float32)
        LIB.symfuse_row_two_smallest(m.data_ptr(), rows, cols, best.data_ptr(), second.data_ptr())
        return best, second
    return m.argmin(1), torch.topk(m, 2, dim=1, largest=False).values[:, 1]
