"""RegMean's Gram systems built in one pass per Gram.

:func:`build_system` gives the same :class:`~symfuse.merge.regmean.GramSystem` as
:func:`~symfuse.merge.regmean.gram_system` with less memory traffic: the reference model's Gram is read first
(as stored), then each other Gram is read once, cache-sized chunk by chunk (each chunk read from the file into
a per-thread buffer when the Grams come from statistics files, so it is still in cache when used: the Gram never
passes through memory whole), added into the sum ``S`` and subtracted from the reference straight into the solve
dtype (``G_i - G_r`` from the stored values, so a float64 file loses nothing to an early rounding). The
off-diagonal scaling ``alpha`` is applied in the same chunk; the diagonals are restored from the stored ones; a NaN
/ inf anywhere shows in ``S`` and is then traced to its file. The chunk passes are shared out to the torch threads
(:func:`symfuse.merge.base.chunked`), and ``S`` is factored with all of them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import torch

from symfuse.errors import NonFiniteError
from symfuse.io import BufferPool
from symfuse.merge.base import SERIAL_CHUNK, LazyTensors, chunked, spans
from symfuse.merge.regmean import GramSystem, factor_system, scale_gram, system_weights

log = logging.getLogger(__name__)


def _load(grams: Sequence[torch.Tensor], i: int, pool: BufferPool | None, slot: str) -> torch.Tensor:
    if isinstance(grams, LazyTensors):
        return grams.load_unchecked(i, pool, slot)
    return grams[i]


def _check(grams: Sequence[torch.Tensor], i: int, t: torch.Tensor) -> None:
    if isinstance(grams, LazyTensors):
        grams.check(i, t)
    elif t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise NonFiniteError(f"regmean: Gram {i} holds NaN / inf values")


_SPAN_BUFFERS = threading.local()  # per thread: one chunk of a Gram as read (reused)


def _streamed_pass(step, span, summed: torch.Tensor, g_ref: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``step`` over a Gram read chunk by chunk into a per-thread buffer, still in cache when ``step`` reads it.

    Instead of reading the Gram whole into memory and then passing over it. Returns its diagonal (float64).
    """
    (n, _), stored, read_span = span
    diag = torch.empty(n, dtype=torch.float64)
    flat_s, flat_r, flat_d = summed.view(-1), g_ref.view(-1), d.view(-1)

    def one(s: int, e: int) -> None:
        buf = getattr(_SPAN_BUFFERS, "buf", None)
        if buf is None or buf.dtype != stored or buf.numel() < e - s:
            buf = _SPAN_BUFFERS.buf = torch.empty(SERIAL_CHUNK, dtype=stored)
        g_ = buf[: e - s]
        read_span(g_, s)
        step(flat_s[s:e], g_, flat_r[s:e], flat_d[s:e])
        first = -(-s // (n + 1))  # the diagonal entries k (n + 1) in [s, e)
        last = (e - 1) // (n + 1)
        if last >= first:
            diag[first : last + 1] = g_[first * (n + 1) - s :: n + 1][: last + 1 - first]

    spans(one, n * n, parallel=True)
    return diag


def build_system(
    grams: Sequence[torch.Tensor],
    model_weights: Sequence[float] | None = None,
    alpha: float = 0.9,
    dtype: torch.dtype = torch.float64,
    pool: BufferPool | None = None,
    raw_pool: BufferPool | None = None,
) -> GramSystem:
    """The factored system of K Grams (see :func:`symfuse.merge.regmean.gram_system`; same arguments, result).

    ``raw_pool`` (default ``pool``) holds the Grams as read (two buffers), ``pool`` the system itself.

    Raises:
        ValueError: a bad alpha, non-square Grams or Grams of different sizes.
        NonFiniteError: a Gram holds NaN / inf (named by its loader), or their sum overflows ``dtype``.
    """
    mw = system_weights(len(grams), model_weights, alpha)
    pool = pool if pool is not None else BufferPool()
    raw_pool = raw_pool if raw_pool is not None else pool
    ref = max(range(len(mw)), key=mw.__getitem__)
    g_ref = _load(grams, ref, raw_pool, "gram.ref")
    n = g_ref.shape[0]
    if g_ref.dim() != 2 or g_ref.shape != (n, n):
        raise ValueError(f"regmean: Grams must be square and of one size, got {tuple(g_ref.shape)}")
    summed = pool.take("summed", (n, n), dtype)
    c_ref = mw[ref]
    chunked(lambda s_, r_: torch.mul(r_, c_ref * alpha, out=s_), summed, g_ref, parallel=True)
    diag_ref = g_ref.diagonal().to(torch.float64)
    diag_sum = c_ref * diag_ref
    diffs: list[torch.Tensor | None] = [None] * len(mw)
    for i, c in enumerate(mw):
        if i == ref:
            continue
        span = grams.span(i) if isinstance(grams, LazyTensors) and c != 0.0 else None
        g = _load(grams, i, raw_pool, "gram.raw") if span is None else None
        shape = tuple(g.shape) if g is not None else tuple(span[0])  # type: ignore[index]
        if shape != (n, n):
            raise ValueError(f"regmean: Grams must be square and of one size, got {shape} and ({n}, {n})")
        if c == 0.0:  # adds nothing; still refused when corrupt
            _check(grams, i, g)  # type: ignore[arg-type]
            continue
        d = pool.take(f"gram{i}", (n, n), dtype)

        def step(s_: torch.Tensor, g_: torch.Tensor, r_: torch.Tensor, d_: torch.Tensor, c: float = c) -> None:
            s_.add_(g_, alpha=c * alpha)  # S += c alpha G_i (diagonal fixed below)
            torch.sub(g_, r_, out=d_)  # G_i - G_r from the stored values, rounded once
            if alpha != 1.0:
                d_.mul_(alpha)

        if span is None:
            chunked(step, summed, g, g_ref, d, parallel=True)
            diag_i = g.diagonal().to(torch.float64)  # type: ignore[union-attr]
        else:
            diag_i = _streamed_pass(step, span, summed, g_ref, d)
        diag_sum += c * diag_i
        d.diagonal().copy_(diag_i - diag_ref)
        diffs[i] = d
    summed.diagonal().copy_(diag_sum)
    if not bool(torch.isfinite(summed.sum())):  # NaN / inf in a Gram propagate into S: find the file
        for i in range(len(mw)):
            _check(grams, i, _load(grams, i, raw_pool, "gram.raw") if i != ref else g_ref)
        raise NonFiniteError(
            f"regmean: the summed Gram ({n} x {n}) overflows {dtype} — merge with dtype float64 (--dtype float64)"
        )
    return factor_system(
        summed, diffs, mw, ref, pool, lambda out: out.copy_(scale_gram(g_ref.to(dtype), alpha)).mul_(sum(mw))
    )
