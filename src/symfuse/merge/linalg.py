"""RegMean's dense linear algebra on CPU, in place: torch's BLAS / LAPACK or scipy's (OpenBLAS).

torch's x86 wheels call MKL, which runs generic code on CPUs that are not Intel's. On the 2-core AMD EPYC of
``bench/results/merge_speed.md`` scipy's OpenBLAS does the same float32 work in less time: Cholesky of a
(3072, 3072) Gram 52 ms against torch's 103, its two triangular solves for 768 right-hand sides 64 against 110
(``cholesky_solve`` also copies the factor on every call), the (3072, 3072) x (3072, 768) product 61 against 72,
(768, 768) products 3.8 against 8.3. ``linalg="auto"`` (:func:`resolve`) takes scipy on x86 CPUs of other vendors
and torch elsewhere; ``torch`` / ``scipy`` force one.

Every operation works in the caller's memory, without copies: a row-major (C-order) torch tensor is the
Fortran-order array of its transpose, and the summed Gram and its differences are symmetric, so each one is its
own Fortran-order view. The factor is stored as LAPACK leaves it, which for the scipy path is ``L^T`` in row-major
terms (the :class:`Factor` hides which).
"""

from __future__ import annotations

import functools
import logging
import platform
from dataclasses import dataclass
from typing import Literal

import torch

log = logging.getLogger(__name__)

Backend = Literal["auto", "torch", "scipy"]


@functools.cache
def _cpu_vendor() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def resolve(backend: Backend) -> Literal["torch", "scipy"]:
    """The backend ``auto`` stands for here: scipy on x86-64 CPUs that are not Intel's (MKL's slow path), else torch."""
    if backend != "auto":
        return backend
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    vendor = _cpu_vendor()
    return "scipy" if x86 and vendor and vendor != "GenuineIntel" else "torch"


@functools.cache
def _threads_controller():
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:  # scipy's OpenBLAS keeps its own default (one thread per CPU)
        return None
    import scipy.linalg  # noqa: F401  (loads its OpenBLAS, so that the controller sees it)

    return ThreadpoolController().select(internal_api="openblas")


_applied: list[int] = []


def sync_threads() -> None:
    """Give scipy's OpenBLAS as many threads as torch has (``torch.set_num_threads``), when threadpoolctl is there."""
    n = torch.get_num_threads()
    if _applied and _applied[0] == n:
        return
    ctl = _threads_controller()
    if ctl is not None:
        ctl.limit(limits=n)
    _applied[:] = [n]


def _np(t: torch.Tensor):
    """The Fortran-order numpy array of a contiguous 2-D tensor's transpose (same memory)."""
    return t.numpy().T


@dataclass
class Factor:
    """The Cholesky factor of a symmetric matrix, in the memory it was factored in.

    Attributes:
        data: The factored tensor: ``L`` (row-major lower) for torch, ``L^T`` (row-major upper) for scipy.
        backend: ``torch`` or ``scipy``.
    """

    data: torch.Tensor
    backend: str

    @property
    def lower(self) -> torch.Tensor:
        """``L`` with ``S = L L^T`` (a new tensor: on the scipy path the other triangle of ``data`` holds ``S``)."""
        return self.data.tril() if self.backend == "torch" else self.data.mT.tril()

    def diagonal(self) -> torch.Tensor:
        """The diagonal of ``L``."""
        return self.data.diagonal()


def cholesky_(s: torch.Tensor, backend: Literal["torch", "scipy"]) -> Factor | None:
    """Factor the symmetric positive definite ``s`` (n, n) in place; None (``s`` then undefined) when it is not.

    On the scipy path the other triangle keeps ``S``'s entries (LAPACK never reads them; zeroing them cost 40 % of
    the factorisation of a (3072, 3072) Gram): use :attr:`Factor.lower` for the triangular matrix.
    """
    if backend == "torch":
        info = torch.empty((), dtype=torch.int32)
        torch.linalg.cholesky_ex(s, out=(s, info))
        return Factor(s, "torch") if int(info) == 0 else None
    from scipy.linalg import get_lapack_funcs

    a = _np(s)  # S^T = S: the Fortran view is S itself
    (potrf,) = get_lapack_funcs(("potrf",), (a,))
    out, info = potrf(a, lower=1, clean=0, overwrite_a=1)
    if out.ctypes.data != a.ctypes.data:  # never expected: the wrapper copied
        a[...] = out
    return Factor(s, "scipy") if info == 0 else None


def cholesky_solve_t_(b: torch.Tensor, factor: Factor) -> torch.Tensor:
    """``(S^-1 b^T)^T`` for a row-major ``b`` (m, n) holding a right-hand side transposed; ``b`` may be overwritten.

    Returns:
        The row-major (m, n) solution, transposed like ``b`` (``b`` itself on the scipy path).
    """
    if factor.backend == "torch":
        return torch.cholesky_solve(b.T, factor.data).T
    from scipy.linalg import get_lapack_funcs

    rhs = _np(b)  # Fortran-order (n, m): b^T
    (potrs,) = get_lapack_funcs(("potrs",), (rhs,))
    x, info = potrs(_np(factor.data), rhs, lower=1, overwrite_b=1)
    if info != 0:
        raise ValueError(f"potrs: argument {-info} is invalid")
    if x.ctypes.data != rhs.ctypes.data:  # never expected: the wrapper copied
        rhs[...] = x
    return b


def addmm_(
    c: torch.Tensor, a: torch.Tensor, g: torch.Tensor, beta: float, alpha: float, backend: str, a_t: bool = False
) -> None:
    """``c = beta c + alpha a g`` in place, for row-major ``c`` (m, n), ``a`` (m, n) and a SYMMETRIC ``g`` (n, n).

    ``a_t``: ``a`` is (n, m) and ``c = beta c + alpha a^T g`` (a layer stored (in, out), GPT-2 ``Conv1D``).
    ``beta = 0`` ignores ``c``'s contents (NaN included).
    """
    if backend == "torch":
        c.addmm_(a.T if a_t else a, g, beta=beta, alpha=alpha)
        return
    from scipy.linalg import get_blas_funcs

    cf = _np(c)  # Fortran (n, m): c^T = beta c^T + alpha g a^T (g^T = g)
    (gemm,) = get_blas_funcs(("gemm",), (cf,))
    out = gemm(alpha, _np(g), _np(a), beta=beta, c=cf, trans_b=1 if a_t else 0, overwrite_c=1)
    if out.ctypes.data != cf.ctypes.data:  # never expected: the wrapper copied
        cf[...] = out
