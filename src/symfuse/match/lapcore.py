"""ctypes bindings of the compiled assignment kernels (``_lapcore.c``), or None where they were not built.

The C file is built by ``pip install`` (``setup.py``; optional: without a compiler the install goes on and
:mod:`symfuse.match.assignment` runs its torch kernels). ctypes releases the GIL for the call, so matching
threads run these in parallel. Inputs are checked here (dtype, contiguity, shapes): the C side trusts them.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_P, _I, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double


def _load() -> ctypes.CDLL | None:
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / f"_lapcore{suffix}"
        if path.exists():
            try:
                lib = ctypes.CDLL(str(path))
            except OSError as e:  # wrong platform / corrupt build: the torch kernels still work
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


def _square_f32(cost: torch.Tensor) -> int:
    if cost.dtype != torch.float32 or not cost.is_contiguous() or cost.device.type != "cpu":
        raise ValueError(f"cost must be a contiguous float32 CPU tensor, got {cost.dtype} on {cost.device}")
    if cost.dim() != 2 or cost.shape[0] != cost.shape[1]:
        raise ValueError(f"cost must be square, got shape {tuple(cost.shape)}")
    return cost.shape[0]


def _check_range(idx: torch.Tensor, n: int, what: str) -> None:
    """Indices the C side will dereference must lie in ``0..n-1``."""
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
        raise ValueError(f"{what} must lie in 0..{n - 1}")


def candidates(cost: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Columns of each row's ``k`` smallest column-reduced entries (n, k), rows of each column's (n, k), max |C|.

    max |C| is infinite when ``cost`` holds NaN or inf; the index tensors are then meaningless.
    """
    n = _square_f32(cost)
    if not 1 <= k <= n or n >= 2**31:
        raise ValueError(f"k must be in 1..{n} (and n < 2**31), got k={k}")
    rows_k = torch.empty(n, k, dtype=torch.long)
    cols_k = torch.empty(n, k, dtype=torch.long)
    abs_max = ctypes.c_float()
    if LIB.symfuse_candidates(cost.data_ptr(), n, k, rows_k.data_ptr(), cols_k.data_ptr(), ctypes.byref(abs_max)):
        raise MemoryError(f"assignment candidates: no memory for {n} x {k} heaps")
    return rows_k, cols_k, abs_max.value


SETTLED, NEGATIVE_CYCLE, OVER_BUDGET = 0, 1, 2


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

    Args:
        cost: (n, n) contiguous float32.
        indptr: (n + 1,) int64 CSR row pointer of the candidates.
        cols: (m,) int64 column of each candidate, by row (each in ``0..n-1``).
        x: (n,) int64 permutation; row ``i``'s edges leave node ``x[i]``.
        d: (n,) float64 start potentials, overwritten.
        tol: Smallest improvement a relaxation counts.
        max_relax: Relaxations at most.

    Returns:
        ``SETTLED`` (``d`` is a fixed point), ``NEGATIVE_CYCLE``, or ``OVER_BUDGET`` (``d`` lowered, not settled).
    """
    n = _square_f32(cost)
    for t in (indptr, cols, x):
        if t.dtype != torch.long or not t.is_contiguous():
            raise ValueError(f"potentials: expected contiguous int64, got {t.dtype}")
    if d.dtype != torch.float64 or not d.is_contiguous() or d.numel() != n or indptr.numel() != n + 1:
        raise ValueError("potentials: d must be contiguous float64 (n,), indptr (n + 1,)")
    if x.numel() != n or int(indptr[-1]) != cols.numel():
        raise ValueError("potentials: x must be (n,) and indptr must end at the number of candidates")
    _check_range(x, n, "potentials: x")
    _check_range(cols, n, "potentials: cols")
    status = LIB.symfuse_potentials(
        cost.data_ptr(), n, indptr.data_ptr(), cols.data_ptr(), x.data_ptr(), d.data_ptr(), tol, max_relax
    )
    if status < 0:
        raise MemoryError(f"assignment potentials: no memory for {n} nodes")
    return status


def violations(
    cost: torch.Tensor, x: torch.Tensor, v: torch.Tensor, tol: float, cap: int, rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, int]:
    """Flat indices of (up to ``cap``) entries with ``C[i, j] - u_i - v_j < -tol``, and how many there are.

    ``u_i = C[i, x_i] - v_{x_i}``. Only the given ``rows`` (int64) are checked when given, else all.
    """
    n = _square_f32(cost)
    if x.dtype != torch.long or v.dtype != torch.float64 or x.numel() != n or v.numel() != n:
        raise ValueError("violations: x must be int64 (n,), v float64 (n,)")
    x, v = x.contiguous(), v.contiguous()
    _check_range(x, n, "violations: x")
    if rows is not None:
        rows = rows.to(torch.long).contiguous()
        _check_range(rows, n, "violations: rows")
        if rows.numel() == 0:  # (an empty tensor's data pointer may be NULL, which the C side reads as "all rows")
            return torch.empty(0, dtype=torch.long), 0
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


def sqdist_columns(s: torch.Tensor, a: torch.Tensor, cols: torch.Tensor, out: torch.Tensor) -> None:
    """``out[i] += sum_r (s[r, i] - a[r, cols[i]])²`` (float32 differences, float64 sums), in place.

    Args:
        s: (d, m) float32 with contiguous rows (a column slice of a bigger matrix is fine).
        a: (d, n) float32 with contiguous rows.
        cols: (m,) int64 in ``0..n-1``.
        out: (m,) contiguous float64.
    """
    (d, m), n = s.shape, a.shape[1]
    if s.dtype != torch.float32 or a.dtype != torch.float32 or s.stride(1) != 1 or a.stride(1) != 1:
        raise ValueError("sqdist_columns: s and a must be float32 with contiguous rows")
    if a.shape[0] != d or cols.shape != (m,) or cols.dtype != torch.long or out.shape != (m,):
        raise ValueError(f"sqdist_columns: shapes {tuple(s.shape)}, {tuple(a.shape)}, {tuple(cols.shape)}")
    if out.dtype != torch.float64 or not out.is_contiguous():
        raise ValueError("sqdist_columns: out must be contiguous float64")
    cols = cols.contiguous()
    _check_range(cols, n, "sqdist_columns: cols")
    LIB.symfuse_sqdist_columns(
        s.data_ptr(), s.stride(0), a.data_ptr(), a.stride(0), d, m, cols.data_ptr(), out.data_ptr()
    )


def row_two_smallest(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of a contiguous float32 (rows, cols >= 2) matrix: argmin (first on ties), second smallest value.

    One pass; ``torch.topk(m, 2, largest=False)`` gives the same, about 2x slower.
    """
    if m.dtype != torch.float32 or not m.is_contiguous() or m.dim() != 2 or not 2 <= m.shape[1] < 2**31:
        raise ValueError(f"row_two_smallest: need a contiguous float32 matrix with >= 2 columns, got {m.shape}")
    rows, cols = m.shape
    best = torch.empty(rows, dtype=torch.long)
    second = torch.empty(rows, dtype=torch.float32)
    LIB.symfuse_row_two_smallest(m.data_ptr(), rows, cols, best.data_ptr(), second.data_ptr())
    return best, second
