"""RegMean's Gram systems: the scaled Grams as differences to a reference, and the Cholesky factor of their sum.

:func:`build_system` gives the same :class:`GramSystem` as
:func:`gram_system` (one tensor at a time) with a fraction of its memory traffic. The Grams are walked together,
one cache-sized chunk at a time: each model's chunk is read as stored (from its statistics file into a per-thread
buffer when the Grams come from files, so no Gram ever passes through memory whole), and while the reference
model's chunk and the chunk of the sum ``S`` stay in cache every other model's difference ``G_i - G_r`` is taken
from the stored values (in the wider of the stored and the solve dtype, so a float64 file loses nothing to an early
rounding), rounded once into the solve dtype and added into ``S = (sum_i c_i) G_r + sum_i c_i (G_i - G_r)``. Every
op is between tensors of one dtype: a float64-stored chunk is converted once (torch's mixed-dtype loops ran 2-4x
slower). Per element that is one read of each Gram, one write of ``S`` and of each difference: the reference and
``S`` are not re-read once per model. The off-diagonal scaling ``alpha`` is applied in the same chunk; the
diagonals are restored from the stored ones; a NaN / inf anywhere shows in ``S`` and is then traced to its file.
The chunks are shared out to the torch threads (:func:`symfuse.merge.base.spans`), and ``S`` is factored with all
of them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from symfuse.errors import NonFiniteError, StatsMismatchError
from symfuse.io import BufferPool
from symfuse.merge.base import Chunks, LazyTensors, chunk_buffer, chunked, chunked_sum, load_all, spans

log = logging.getLogger(__name__)


@dataclass
class GramSystem:
    """One layer input's K scaled Grams, as differences to a reference, and the Cholesky factor of their sum.

    Attributes:
        diffs: Per model, ``G_i' - G_r'`` (in, in) in the solve dtype; None for the reference model ``r`` and
            for models of weight 0 (they add nothing to the correction).
        weights: The K model weights ``c_i``.
        summed: The memory of the Cholesky factor of ``S = sum_i c_i G_i'`` (factored in place), or ``S`` itself
            when it is not positive definite.
        factor: The lower Cholesky factor ``L`` (``summed`` itself), None after the lstsq fallback.
        cond: ``(max diag L / min diag L)^2``, a lower bound on cond(S) (inf when not positive definite).
        ref: Index of the reference model (largest weight).
        pool: The buffers holding the tensors (None: own memory).
    """

    diffs: list[torch.Tensor | None]
    weights: list[float]
    summed: torch.Tensor
    factor: torch.Tensor | None
    cond: float
    ref: int
    pool: BufferPool | None = None
    _bf16: torch.Tensor | None = None

    def bf16_diffs(self) -> torch.Tensor:
        """The non-None diffs stacked ((m in, in), bfloat16), computed once per system."""
        if self._bf16 is None:
            self._bf16 = torch.cat([d.to(torch.bfloat16) for d in self.diffs if d is not None], dim=0)
        return self._bf16


def scale_gram(g: torch.Tensor, alpha: float) -> torch.Tensor:
    """``alpha G + (1 - alpha) diag(G)`` IN PLACE (only off-diagonals are scaled); returns ``g``."""
    if alpha != 1.0:
        diag = g.diagonal().clone()
        g.mul_(alpha)
        g.diagonal().copy_(diag)
    return g


def system_weights(k: int, model_weights: Sequence[float] | None, alpha: float) -> list[float]:
    """The K model weights of a Gram system (default 1 each), with ``alpha`` and the weights checked.

    Raises:
        ValueError: alpha outside [0, 1], or not K non-negative weights with a positive sum.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"regmean alpha must be in [0, 1], got {alpha}")
    mw = [float(c) for c in model_weights] if model_weights is not None else [1.0] * k
    if len(mw) != k or not mw or min(mw) < 0 or sum(mw) <= 0:
        raise ValueError(f"regmean: {k} Grams need as many non-negative weights with a positive sum, got {mw}")
    return mw


def gram_system(
    grams: Sequence[torch.Tensor],
    model_weights: Sequence[float] | None = None,
    alpha: float = 0.9,
    dtype: torch.dtype = torch.float64,
    pool: BufferPool | None = None,
) -> GramSystem:
    """Read K Grams, scale their off-diagonals, sum them and factor the sum.

    Args:
        grams: K input Grams (in, in) (a lazy sequence is read once, one access per model).
        model_weights: K non-negative weights (default 1 each).
        alpha: Off-diagonal scale in [0, 1].
        dtype: Compute precision.
        pool: Reuse these buffers for the Grams and the factor (valid until the next call with the same pool).

    Returns:
        The factored system; the caller's Gram tensors are never modified.

    Raises:
        ValueError: on a bad alpha, non-square Grams or Grams of different sizes.
    """
    mw = system_weights(len(grams), model_weights, alpha)
    fused = alpha > 0.0  # scale while converting (one pass), then restore the diagonal
    mine = load_all(grams, pool, "gram", dtype, scale=alpha if fused else 1.0)  # K (in, in), ours to modify
    n = mine[0].shape[0]
    summed = pool.take("summed", (n, n), dtype) if pool is not None else torch.empty((n, n), dtype=dtype)
    for i, (g, c) in enumerate(zip(mine, mw, strict=True)):
        if g.shape != (n, n):
            raise ValueError(f"regmean: Grams must be square and of one size, got {tuple(g.shape)} and ({n}, {n})")
        if fused and alpha != 1.0:
            g.diagonal().div_(alpha)  # load_all scaled everything by alpha: restore the diagonal
        elif not fused:
            scale_gram(g, alpha)
        if not bool(g.diagonal().any()):  # a zero Gram (O(n) to see): its check names the file (it would pass here)
            _check(grams, i, g)
        if i == 0:
            chunked(lambda s_, g_, c=c: torch.mul(g_, c, out=s_), summed, g)
        else:
            chunked(lambda s_, g_, c=c: s_.add_(g_, alpha=c), summed, g)
    ref = max(range(len(mw)), key=mw.__getitem__)
    diffs: list[torch.Tensor | None] = [None] * len(mw)
    for i, g in enumerate(mine):
        if i != ref and mw[i] != 0.0:
            chunked(torch.Tensor.sub_, g, mine[ref])  # in place: the Grams themselves are not needed any more
            diffs[i] = g
    return factor_system(summed, diffs, mw, ref, pool, lambda out: torch.mul(mine[ref], sum(mw), out=out))


def factor_system(
    summed: torch.Tensor,
    diffs: list[torch.Tensor | None],
    mw: list[float],
    ref: int,
    pool: BufferPool | None,
    reference_part: Callable[[torch.Tensor], object],
) -> GramSystem:
    """Cholesky-factor the summed Gram ``S`` in place into a :class:`GramSystem`.

    When ``S`` is not positive definite it is rebuilt as ``(sum_i c_i) G_r' + sum_i c_i (G_i' - G_r')`` and the
    system solves by lstsq: ``reference_part(out)`` writes the first term (``(sum_i c_i) G_r'``) into ``out``.
    """
    n = summed.shape[0]
    info = torch.empty((), dtype=torch.int32)
    # in place (S is not needed once factored), through the column-major view of the symmetric S: LAPACK's layout,
    # so nothing is copied in or out; its upper factor U = L^T, read row-major, is L
    torch.linalg.cholesky_ex(summed.mT, upper=True, out=(summed.mT, info))
    if int(info) != 0:
        reference_part(summed)  # it may refuse a corrupt Gram first
        log.warning("regmean: summed Gram (%d x %d) is not positive definite; solving by lstsq", n, n)
        for d, c in zip(diffs, mw, strict=True):
            if d is not None:
                summed.add_(d, alpha=c)
        return GramSystem(diffs, mw, summed, None, math.inf, ref, pool)
    dg = summed.diagonal()
    cond = float((dg.max() / dg.min()) ** 2)
    return GramSystem(diffs, mw, summed, summed, cond, ref, pool)


def _load(grams: Sequence[torch.Tensor], i: int, pool: BufferPool | None, slot: str) -> torch.Tensor:
    if isinstance(grams, LazyTensors):
        return grams.load_unchecked(i, pool, slot)
    return grams[i]


def _check(grams: Sequence[torch.Tensor], i: int, t: torch.Tensor) -> None:
    if isinstance(grams, LazyTensors):
        grams.check(i, t)
        return
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise NonFiniteError(f"regmean: Gram {i} holds NaN / inf values")
    check_gram_diagonal(t, "a layer", f"regmean: Gram {i}")


def check_gram_diagonal(t: torch.Tensor, module: str, where: object) -> torch.Tensor:
    """Refuse a Gram ``X^T X`` with a negative diagonal entry (a sum of squares) or a zero one: a corrupt file.

    Such a Gram makes the summed system indefinite, which RegMean would solve by lstsq with a warning naming no file.

    Raises:
        StatsMismatchError: naming ``where`` and ``module``.
    """
    if t.dim() == 2 and t.shape[0] == t.shape[1] and t.numel():
        diagonal = t.diagonal()
        low, high = float(diagonal.min()), float(diagonal.max())
        fix = "recollect it with `symfuse stats MODEL --data DATA --kind gram`"
        if low < 0:
            raise StatsMismatchError(
                f"{where}: the Gram of {module} has a negative diagonal entry ({low:.3g}); a Gram is a sum of "
                f"products X^T X, whose diagonal never is — {fix}"
            )
        if high == 0:  # X = 0 for every token: RegMean gave this model no say in the layer, without a word
            raise StatsMismatchError(f"{where}: the Gram of {module} is zero: no input reached the layer, or the file "
                                     f"was zeroed — {fix}")  # fmt: skip
    return t


def build_system(
    grams: Sequence[torch.Tensor],
    model_weights: Sequence[float] | None = None,
    alpha: float = 0.9,
    dtype: torch.dtype = torch.float64,
    pool: BufferPool | None = None,
    raw_pool: BufferPool | None = None,
) -> GramSystem:
    """The factored system of K Grams (see :func:`gram_system`; same arguments, result).

    ``raw_pool`` (default ``pool``) holds Grams that cannot be read in spans (whole, one buffer per model; see
    :class:`~symfuse.merge.base.Chunks`), ``pool`` the system itself.

    Raises:
        ValueError: a bad alpha, non-square Grams or Grams of different sizes.
        NonFiniteError: a Gram holds NaN / inf (named by its loader), or their sum overflows ``dtype``.
    """
    mw = system_weights(len(grams), model_weights, alpha)
    pool = pool if pool is not None else BufferPool()
    raw_pool = raw_pool if raw_pool is not None else pool
    ref = max(range(len(mw)), key=mw.__getitem__)
    chunks = Chunks(grams, raw_pool, "gram.raw")  # each Gram's chunks as stored
    shape = chunks.shapes[ref]
    n = shape[0]
    if len(shape) != 2 or shape != (n, n):
        raise ValueError(f"regmean: Grams must be square and of one size, got {shape}")
    diffs = _difference_buffers(grams, chunks, mw, ref, dtype, pool, raw_pool)
    summed = pool.take("summed", (n, n), dtype)
    fused = _FusedSum(chunks, diffs, mw, ref, alpha, summed)
    spans(fused, n * n, parallel=True)
    total = fused.restore_diagonals()
    for i, d in enumerate(fused.diags):  # every stored diagonal, gathered on the way: a corrupt Gram's file is named
        if bool((d < 0).any()) or not bool(d.any()):  # (a negative or zero one; O(n), it passed a positive S before)
            _check(grams, i, _load(grams, i, raw_pool, "gram.raw"))
    if not math.isfinite(total):  # the chunks' sums overflowed, or S holds NaN / inf: sum again in float64
        total = chunked_sum(summed)
    if not math.isfinite(total):  # NaN / inf in a Gram propagate into S (the chunks, then its diagonal): find the file
        for i in range(len(mw)):
            _check(grams, i, _load(grams, i, raw_pool, "gram.raw"))
        raise NonFiniteError(
            f"regmean: the summed Gram ({n} x {n}) overflows {dtype} — merge with dtype float64 (--dtype float64)"
        )

    def reference_part(out: torch.Tensor) -> None:  # (sum_i c_i) G_r', for the lstsq fallback
        for i in range(len(mw)):  # S is not positive definite: a corrupt Gram (negative diagonal) is named first
            _check(grams, i, _load(grams, i, raw_pool, "gram.raw"))
        g_ref = _load(grams, ref, raw_pool, "gram.raw").to(dtype, copy=True)
        out.copy_(scale_gram(g_ref, alpha)).mul_(sum(mw))

    return factor_system(summed, diffs, mw, ref, pool, reference_part)


def _difference_buffers(
    grams: Sequence[torch.Tensor],
    chunks: Chunks,
    mw: list[float],
    ref: int,
    dtype: torch.dtype,
    pool: BufferPool,
    raw_pool: BufferPool,
) -> list[torch.Tensor | None]:
    """Per model, the buffer its ``G_i' - G_r'`` is written into: None for the reference and for weight 0.

    A Gram of weight 0 adds nothing, but is still read whole and refused when it has the wrong size or is corrupt.
    """
    n = chunks.shapes[ref][0]
    diffs: list[torch.Tensor | None] = [None] * len(mw)
    for i, c in enumerate(mw):
        if i == ref:
            continue
        if c == 0.0:
            g = _load(grams, i, raw_pool, "gram.raw")
            if tuple(g.shape) != (n, n):
                raise ValueError(f"regmean: Grams must be square and of one size, got {tuple(g.shape)} and ({n}, {n})")
            _check(grams, i, g)
            continue
        if chunks.shapes[i] != (n, n):
            raise ValueError(f"regmean: Grams must be square and of one size, got {chunks.shapes[i]} and ({n}, {n})")
        diffs[i] = pool.take(f"gram{i}", (n, n), dtype)
    return diffs


class _FusedSum:
    """The fused pass over every Gram's chunk ``[s, e)``, the reference's and ``S``'s kept in cache.

    ``S = alpha (sum_i c_i) G_r + sum_i c_i alpha (G_i - G_r)`` off the diagonal, each difference written into its
    buffer; the stored diagonals are gathered on the way and put back by :meth:`restore_diagonals`. Called from
    several threads, each on its own spans.
    """

    def __init__(
        self,
        chunks: Chunks,
        diffs: list[torch.Tensor | None],
        mw: list[float],
        ref: int,
        alpha: float,
        summed: torch.Tensor,
    ):
        self.chunks, self.diffs, self.mw, self.ref, self.alpha, self.summed = chunks, diffs, mw, ref, alpha, summed
        self.n, self.dtype = summed.shape[0], summed.dtype
        self.scale_ref = alpha * sum(mw)  # S's reference term, its diagonal fixed by restore_diagonals
        self.others = [(i, mw[i], d.view(-1)) for i, d in enumerate(diffs) if d is not None]  # (model, c_i, flat)
        self.diags = torch.empty(len(mw), self.n, dtype=torch.float64)  # each Gram's stored diagonal
        self.sums: list[torch.Tensor] = []  # per chunk of S: the finiteness check, while the chunk is in cache

    def __call__(self, s: int, e: int) -> None:
        n, dtype, chunks = self.n, self.dtype, self.chunks
        first = -(-s // (n + 1))  # the diagonal entries k (n + 1) in [s, e)
        count = (e - 1) // (n + 1) + 1 - first
        s_, r_ = self.summed.view(-1)[s:e], chunks.read(self.ref, s, e, "ref")
        if count > 0:
            self.diags[self.ref, first : first + count] = r_[first * (n + 1) - s :: n + 1][:count]
        refs = {r_.dtype: r_}  # the reference's chunk in each dtype it is used in, converted once (torch's
        # mixed-dtype loops run 2-4x slower than a conversion and same-dtype ops)

        def ref_in(dt: torch.dtype) -> torch.Tensor:
            if dt not in refs:
                refs[dt] = chunk_buffer("gram.ref", dt, e - s).copy_(r_)
            return refs[dt]

        torch.mul(ref_in(dtype), self.scale_ref, out=s_)
        for i, c, flat_d in self.others:
            g_, d_ = chunks.read(i, s, e, "other"), flat_d[s:e]  # one buffer for them all: stays in cache
            if count > 0:
                self.diags[i, first : first + count] = g_[first * (n + 1) - s :: n + 1][:count]
            # G_i - G_r in the wider of the stored dtypes and the solve's, rounded once into dtype
            wide = torch.promote_types(torch.promote_types(g_.dtype, r_.dtype), dtype)
            if g_.dtype != wide:
                g_ = chunk_buffer("gram.wide", wide, e - s).copy_(g_)
            if wide == dtype:
                torch.sub(g_, ref_in(wide), out=d_)
            else:
                d_.copy_(torch.sub(g_, ref_in(wide), out=chunk_buffer("gram.diff", wide, e - s)))
            if self.alpha != 1.0:
                d_.mul_(self.alpha)
            s_.add_(d_, alpha=c)
        self.sums.append(s_.sum())  # in dtype (fast); a float32 overflow is told from a NaN / inf by the caller

    def restore_diagonals(self) -> float:
        """Put the unscaled diagonals into ``S`` and the differences; returns the sum of ``S`` (may not be finite)."""
        ref, diags = self.ref, self.diags
        diag_sum = self.mw[ref] * diags[ref]
        for i, c, _ in self.others:
            diag_sum += c * diags[i]
            self.diffs[i].diagonal().copy_(diags[i] - diags[ref])  # type: ignore[union-attr]
        self.summed.diagonal().copy_(diag_sum)
        return (float(torch.stack(self.sums).double().sum()) if self.sums else 0.0) + float(diag_sum.sum())
