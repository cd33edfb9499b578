"""RegMean's Gram systems built in one pass per Gram, and the next one built in the background.

:func:`build_system` gives the same :class:`~symfuse.merge.regmean.GramSystem` as
:func:`~symfuse.merge.regmean.gram_system` with less memory traffic: the reference model's Gram is read first
(as stored), then each other Gram is read once and, cache-sized chunk by chunk, added into the sum ``S`` and
subtracted from the reference straight into the solve dtype (``G_i - G_r`` from the stored values, so a float64
file loses nothing to an early rounding). The off-diagonal scaling ``alpha`` is applied in the same chunk; the
diagonals are restored from the stored ones; a NaN / inf anywhere shows in ``S`` and is then traced to its file.

:class:`SystemPrefetcher` builds the NEXT input's system in one background thread (one torch thread; the
reads are ``preadv`` and release the GIL) while the caller's products and solves for the current one run, each
system in its own :class:`BufferPool` (two pools, alternating).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from symfuse.errors import NonFiniteError
from symfuse.io import BufferPool
from symfuse.merge.base import LazyTensors, chunked
from symfuse.merge.regmean import GramSystem, scale_gram

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


def build_system(
    grams: Sequence[torch.Tensor],
    model_weights: Sequence[float] | None = None,
    alpha: float = 0.9,
    dtype: torch.dtype = torch.float64,
    pool: BufferPool | None = None,
) -> GramSystem:
    """The factored system of K Grams (see :func:`symfuse.merge.regmean.gram_system`; same arguments, result).

    Raises:
        ValueError: a bad alpha, non-square Grams or Grams of different sizes.
        NonFiniteError: a Gram holds NaN / inf (named by its loader), or their sum overflows ``dtype``.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"regmean alpha must be in [0, 1], got {alpha}")
    mw = [float(c) for c in model_weights] if model_weights is not None else [1.0] * len(grams)
    if len(mw) != len(grams) or not mw or min(mw) < 0 or sum(mw) <= 0:
        raise ValueError(f"regmean: {len(grams)} Grams need as many non-negative weights with a positive sum, got {mw}")
    pool = pool if pool is not None else BufferPool()
    ref = max(range(len(mw)), key=mw.__getitem__)
    g_ref = _load(grams, ref, pool, "gram.ref")
    n = g_ref.shape[0]
    if g_ref.dim() != 2 or g_ref.shape != (n, n):
        raise ValueError(f"regmean: Grams must be square and of one size, got {tuple(g_ref.shape)}")
    summed = pool.take("summed", (n, n), dtype)
    c_ref = mw[ref]
    chunked(lambda s_, r_: torch.mul(r_, c_ref * alpha, out=s_), summed, g_ref)
    diag_ref = g_ref.diagonal().to(torch.float64)
    diag_sum = c_ref * diag_ref
    diffs: list[torch.Tensor | None] = [None] * len(mw)
    for i, c in enumerate(mw):
        if i == ref:
            continue
        g = _load(grams, i, pool, "gram.raw")
        if g.shape != (n, n):
            raise ValueError(f"regmean: Grams must be square and of one size, got {tuple(g.shape)} and ({n}, {n})")
        if c == 0.0:  # adds nothing; still refused when corrupt
            _check(grams, i, g)
            continue
        d = pool.take(f"gram{i}", (n, n), dtype)

        def step(s_: torch.Tensor, g_: torch.Tensor, r_: torch.Tensor, d_: torch.Tensor, c: float = c) -> None:
            s_.add_(g_, alpha=c * alpha)  # S += c alpha G_i (diagonal fixed below)
            torch.sub(g_, r_, out=d_)  # G_i - G_r from the stored values, rounded once
            if alpha != 1.0:
                d_.mul_(alpha)

        chunked(step, summed, g, g_ref, d)
        diag_i = g.diagonal().to(torch.float64)
        diag_sum += c * diag_i
        d.diagonal().copy_(diag_i - diag_ref)
        diffs[i] = d
    summed.diagonal().copy_(diag_sum)
    if not bool(torch.isfinite(summed.sum())):  # NaN / inf in a Gram propagate into S: find the file
        for i in range(len(mw)):
            _check(grams, i, _load(grams, i, pool, "gram.raw") if i != ref else g_ref)
        raise NonFiniteError(
            f"regmean: the summed Gram ({n} x {n}) overflows {dtype} — merge with dtype float64 (--dtype float64)"
        )
    info = torch.empty((), dtype=torch.int32)
    torch.linalg.cholesky_ex(summed, out=(summed, info))  # in place: S is not needed once factored
    if int(info) != 0:
        log.warning("regmean: summed Gram (%d x %d) is not positive definite; solving by lstsq", n, n)
        # rebuild S = (sum_i c_i) G_r' + sum_i c_i (G_i' - G_r')
        summed.copy_(scale_gram(g_ref.to(dtype), alpha)).mul_(sum(mw))
        for d, c in zip(diffs, mw, strict=True):
            if d is not None:
                summed.add_(d, alpha=c)
        return GramSystem(diffs, mw, summed, None, math.inf, ref, pool)
    dg = summed.diagonal()
    cond = float((dg.max() / dg.min()) ** 2)
    return GramSystem(diffs, mw, summed, summed, cond, ref, pool)


class SystemPrefetcher:
    """Builds Gram systems one step ahead in a background thread (see the module docstring).

    Args:
        alpha: Off-diagonal scale.
        dtype: Solve dtype.
    """

    def __init__(self, alpha: float, dtype: torch.dtype):
        self.alpha, self.dtype = alpha, dtype
        self._pools = [BufferPool(), BufferPool()]
        self._turn = 0
        self._pending: tuple[str, Future[GramSystem]] | None = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="regmean-grams")

    def _build(self, grams: Sequence[torch.Tensor], weights: Sequence[float], pool: BufferPool) -> GramSystem:
        prev = torch.get_num_threads()
        torch.set_num_threads(1)  # per calling thread: the main thread's products keep their threads
        try:
            return build_system(grams, weights, self.alpha, self.dtype, pool)
        finally:
            torch.set_num_threads(prev)

    def get(self, key: str, grams: Sequence[torch.Tensor], weights: Sequence[float]) -> GramSystem:
        """The system of ``key``: the prefetched one when it was asked for, else built now."""
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == key:
            return pending[1].result()
        if pending is not None:
            pending[1].result()  # never leave a build running on a pool about to be reused
        self._turn ^= 1
        return build_system(grams, weights, self.alpha, self.dtype, self._pools[self._turn])

    def ahead(self, key: str, grams: Sequence[torch.Tensor], weights: Sequence[float]) -> None:
        """Start building ``key``'s system in the background (into the pool the current system does not use)."""
        if self._pending is not None:
            return
        self._turn ^= 1
        self._pending = (key, self._thread.submit(self._build, grams, weights, self._pools[self._turn]))

    def close(self) -> None:
        """Wait for a build in flight and stop the thread."""
        if self._pending is not None:
            with contextlib.suppress(Exception):  # its tensor was never merged: nothing to report
                self._pending[1].result()
            self._pending = None
        self._thread.shutdown(wait=True)
