"""The merger plug-in interface: one tensor (from K models, with its statistics) in, one merged tensor out."""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from symfuse.errors import MissingStats, UsageError
from symfuse.merge.registry import MergeParams
from symfuse.runtime import torch_threads
from symfuse.stats.io import BufferPool


class LazyTensors(Sequence[torch.Tensor]):
    """K tensors loaded on access (each access reads again), so a merger that walks them once holds one at a time.

    With a :class:`~symfuse.stats.io.BufferPool`, every access reads into the SAME reusable buffer (slot
    ``slot``): a tensor obtained from it is valid only until the next access, which suits mergers that walk the
    K tensors once and keep nothing (no page faults for fresh memory). :func:`load_all` gives K tensors that
    are all valid at once (one slot per model).

    Args:
        loaders: One function per model, ``loader(pool, slot) -> tensor``, returning memory the caller may
            modify: new memory when ``pool`` is None, else ``pool``'s buffer ``slot``.
        pool: Buffers to read into, or None (every access returns new memory).
        slot: Slot name in ``pool``.
        checks: Optional per-model validation ``check(tensor)`` (raises), run by every access; a caller that
            validates on its own pass reads with :meth:`load_unchecked` and calls :meth:`check` only on doubt.
        spans: Optional per-model ``(shape, dtype, read_span)``: ``read_span(out, first)`` fills the flat ``out``
            (stored dtype) with elements ``first:first + out.numel()`` of the stored tensor, unchecked, so a pass
            can read a tensor chunk by chunk while it computes (:meth:`span`).
    """

    def __init__(
        self,
        loaders: Sequence[Callable[[BufferPool | None, str], torch.Tensor]],
        pool: BufferPool | None = None,
        slot: str = "lazy",
        checks: Sequence[Callable[[torch.Tensor], object]] | None = None,
        spans: Sequence[tuple[tuple[int, ...], torch.dtype, Callable[[torch.Tensor, int], object]]] | None = None,
    ):
        self._loaders = list(loaders)
        self.pool, self.slot = pool, slot
        self._checks = list(checks) if checks is not None else None
        self._spans = list(spans) if spans is not None else None

    def span(self, i: int) -> tuple[tuple[int, ...], torch.dtype, Callable[[torch.Tensor, int], object]] | None:
        """Model ``i``'s ``(shape, stored dtype, read_span)`` when it can be read in spans, else None."""
        return self._spans[i] if self._spans is not None else None

    def __len__(self) -> int:
        return len(self._loaders)

    def load(self, i: int, pool: BufferPool | None, slot: str) -> torch.Tensor:
        """Model ``i``'s tensor, read into ``pool``'s ``slot`` (new memory when ``pool`` is None), validated."""
        t = self._loaders[i](pool, slot)
        self.check(i, t)
        return t

    def load_unchecked(self, i: int, pool: BufferPool | None, slot: str) -> torch.Tensor:
        """Like :meth:`load` without the validation (the caller must :meth:`check` what it doubts)."""
        return self._loaders[i](pool, slot)

    def check(self, i: int, t: torch.Tensor) -> None:
        """Run model ``i``'s validation on ``t`` (raises)."""
        if self._checks is not None:
            self._checks[i](t)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self.load(j, None, "") for j in range(len(self))[i]]
        return self.load(i, self.pool, self.slot)


def load_all(
    tensors: Sequence[torch.Tensor],
    pool: BufferPool | None,
    slot: str,
    dtype: torch.dtype | None,
    scale: float = 1.0,
    stored: list[torch.dtype] | None = None,
) -> list[torch.Tensor]:
    """All K tensors at once, times ``scale``, in ``dtype`` (None: as stored), in NEW memory or ``pool`` slots.

    Model i's tensor uses slot ``{slot}{i}``. The results may be modified in place by the caller: a caller's
    plain tensors are always copied. Conversion and scaling take one pass over memory. ``stored`` (if given)
    receives the K stored dtypes.
    """
    lazy = isinstance(tensors, LazyTensors)
    out = []
    for i in range(len(tensors)):
        raw = tensors.load(i, pool, f"{slot}.raw") if lazy else tensors[i]  # type: ignore[attr-defined]
        if stored is not None:
            stored.append(raw.dtype)
        want = dtype or raw.dtype
        if lazy and raw.dtype == want:  # a lazy load is ours to modify (new memory, or the pool's raw slot)
            if pool is not None:
                pool.swap(f"{slot}.raw", f"{slot}{i}")  # the buffer just read becomes model i's slot, no copy
            if scale != 1.0:
                chunked(lambda r: r.mul_(scale), raw)
            out.append(raw)
            continue
        dst = pool.take(f"{slot}{i}", raw.shape, want) if pool is not None else torch.empty(raw.shape, dtype=want)
        chunked(lambda d, r: torch.mul(r, scale, out=d), dst, raw.contiguous())  # convert and scale, one pass
        out.append(dst)
    return out


@dataclass
class TensorInputs:
    """One tensor of K models and what a merger may need to merge it.

    ``tensors``, ``fisher`` and ``gram`` may be :class:`LazyTensors`: walk them once (``zip``, ``for``) to keep
    memory at one model's tensor; index them once per model.

    Attributes:
        name: Stored tensor name (``bert.encoder.layer.0.attention.self.query.weight``).
        tensors: The K models' tensors (same shape).
        weights: K model weights summing to 1.
        base: The base model's tensor (task-vector mergers), else None.
        fisher: K diagonal Fishers of this tensor, else None.
        gram: K input Grams ``(in, in)`` when the tensor is a linear layer's weight, else None.
        conv1d: The weight is stored (in, out) (GPT-2 ``Conv1D``) instead of ``nn.Linear``'s (out, in).
        gram_key: Identifies the Grams' input: consecutive tensors with the same key read one input (q / k / v)
            and have identical Grams, so a merger may reuse what it computed from them. None: unknown.
        part: Only some rows of the stored tensor, over some of the models (a union head's classes merged over
            their learners): a merger that precomputed whole tensors must merge these inputs instead.
    """

    name: str
    tensors: Sequence[torch.Tensor]
    weights: Sequence[float]
    base: torch.Tensor | None = None
    fisher: Sequence[torch.Tensor] | None = None
    gram: Sequence[torch.Tensor] | None = None
    conv1d: bool = False
    gram_key: str | None = None
    part: bool = False


class Merger:
    """Base of the registered mergers.

    Subclasses set ``name``, ``required_stats`` (kinds of :mod:`symfuse.stats` files they read), ``needs_base``
    (or ``accepts_base``: a base model is optional), ``model_count`` (how many models it merges), ``run_params``
    (parameters the merge task takes from the run), a pydantic ``Params`` class, and implement :meth:`merge_tensor`,
    which must return a NEW tensor and never modify its inputs.
    """

    name: ClassVar[str]
    required_stats: ClassVar[frozenset[str]] = frozenset()
    needs_base: ClassVar[bool] = False
    needs_data: ClassVar[bool] = False  # reads the models' datasets in :meth:`prepare` (RegMean++)
    # Params fields the merge task fills from the run (tasks/merge.py run_context: data, max_examples, batch_size,
    # max_length, seed, device), e.g. a merger that runs each model's own dataset; the user's merge_params win.
    run_params: ClassVar[tuple[str, ...]] = ()
    # True when a NaN / inf in any input tensor (or Fisher) always reaches the merged tensor (every input enters a
    # sum with its weight, 0 included): merge_checkpoints then reads the inputs unchecked and checks them only
    # when the output is not finite, to name the file. Mergers that select or drop entries (TIES, DARE) keep False.
    propagates_nonfinite: ClassVar[bool] = False
    # a base model may be given without being required (nuslerp, multislerp: they then work on task vectors)
    accepts_base: ClassVar[bool] = False
    # how many models it merges: (fewest, most), most None for no limit (slerp: (2, 2); passthrough: (1, 1))
    model_count: ClassVar[tuple[int, int | None]] = (2, None)
    Params: ClassVar[type[MergeParams]] = MergeParams

    def __init__(self, **params: Any):
        self.params = self.Params(**params)
        self.counters: dict[str, int] = {}
        self.pool: BufferPool | None = None  # scratch buffers a merger may reuse (set by merge_checkpoints)
        # where merge_tensor's inputs live and its maths runs (set by merge_checkpoints; off the CPU, mergers take
        # whole-tensor torch ops and no pool)
        self.device = torch.device("cpu")

    @classmethod
    def merges(cls, k: int) -> bool:
        """Whether this strategy merges ``k`` models (see ``model_count``)."""
        lo, hi = cls.model_count
        return lo <= k and (hi is None or k <= hi)

    @classmethod
    def count_words(cls) -> str:
        """How many models it merges, in words: ``two or more``, ``exactly two``, ``exactly one``."""
        lo, hi = cls.model_count
        words = {1: "one", 2: "two", 3: "three"}
        if hi is None:
            return f"{words.get(lo, lo)} or more"
        if hi == lo:
            return f"exactly {words.get(lo, lo)}"
        return f"{words.get(lo, lo)} to {words.get(hi, hi)}"

    @classmethod
    def check_model_count(cls, k: int) -> None:
        """Refuse ``k`` models in one line when this strategy merges another number (see ``model_count``).

        Raises:
            UsageError: ``--models: <k> model(s) given — <what it merges>: <the fix>``.
        """
        lo, hi = cls.model_count
        if cls.merges(k):
            return
        want = cls.count_words()
        example = " ".join("ABC"[: min(lo, 3)]) + (" [C ...]" if hi is None and lo < 3 else "")
        strategy = f"{cls.name} merges" if (lo, hi) != (2, None) else "give"
        raise UsageError(f"--models: {k} model(s) given — {strategy} {want}: --models {example}")

    def close(self) -> None:
        """Release background work and buffers (called once the merge is done or failed)."""

    def count(self, what: str) -> None:
        """Count an event for the merge report (e.g. ``lstsq_fallback``)."""
        self.counters[what] = self.counters.get(what, 0) + 1

    def model_weights(self, k: int) -> list[float]:
        """The K normalised model weights."""
        w = self.params.weights or [1.0] * k
        if len(w) != k or sum(w) <= 0 or min(w) < 0:
            raise ValueError(f"{self.name}: weights {w} must be {k} non-negative numbers with a positive sum")
        top = float(max(w))  # scaled first: weights near the float maximum would sum to inf (every share 0)
        s = sum(float(x) / top for x in w)
        return [float(x) / top / s for x in w]

    def prepare(self, models: Sequence[Any], keep: frozenset[str] = frozenset()) -> None:
        """Called once with the K checked checkpoint folders before the first :meth:`merge_tensor` (default: nothing).

        A merger whose tensors depend on the whole models (RegMean++) does its work here. ``keep``: tensor names kept
        per model (per-dataset heads), not merged.
        """

    def supplied_grams(self, module: str) -> list[torch.Tensor] | None:
        """K input Grams of a linear module that the merger collected itself (RegMean++), else None (the default)."""
        return None

    def merge_tensor(self, t: TensorInputs) -> torch.Tensor:
        """Merge one tensor of K models."""
        raise NotImplementedError

    def output_finite(self, out: torch.Tensor) -> bool | None:
        """Whether ``out``, what :meth:`merge_tensor` just returned, is all finite, if the merger already knows.

        None (the default): ``merge_checkpoints`` checks it. A merger that took the output's sum in its last pass
        over it answers True and spares that pass.
        """
        return None

    def check_inputs(self, t: TensorInputs) -> None:
        """Raise a clear error if the tensor lacks what this merger needs."""
        if self.needs_base and t.base is None:
            raise MissingStats(f"{self.name}: no base tensor for {t.name}; pass --base")


SERIAL_CHUNK = 131_072  # elements per elementwise op, run with ONE torch thread in each of the pass's threads
# Memory-bound elementwise loops gain little from a second torch thread, and on a shared CPU OpenMP's barriers wait
# for a descheduled thread: 2-thread elementwise ops measured 10-18x slower than 1-thread ones on this 2-core
# machine under load. So each chunk's ops run single-threaded (torch_threads(1) in every thread of a pass; until
# stop 22 chunks of 32,000 elements stayed under torch's grain size instead) and the pass's own threads share the
# chunks. Per op torch spends ~3 us in Python and dispatch: a (3072, 3072) Gram system's fused pass (K = 5) took
# 71 ms in 32,000-element chunks, 45 of them without the reads, mostly per-chunk overhead; 31 ms in 131,072-element
# ones (a numpy version of the pass measured the same). The chunks stay in L3; BLAS / LAPACK calls keep every thread.


def chunked(fn: Callable[..., Any], *tensors: torch.Tensor, parallel: bool = False) -> None:
    """Call ``fn`` on matching flat chunks of contiguous tensors of one size (``fn`` works in place).

    ``parallel``: the chunks are shared out to up to ``torch.get_num_threads()`` (at most 4) Python threads, each
    taking the next chunk when done with its own (no barrier: a descheduled thread delays one chunk, not all);
    ``fn`` must then touch nothing but its chunks. For passes over large tensors (a (3072, 3072) Gram: 1.7x
    faster with two threads here).
    """
    flat = [t.view(-1) for t in tensors]
    if flat[0].device.type != "cpu":  # a device runs one kernel over the whole tensor
        fn(*flat)
        return
    spans(lambda s, e: fn(*(f[s:e] for f in flat)), flat[0].numel(), parallel)


def spans(fn: Callable[[int, int], Any], n: int, parallel: bool = False) -> None:
    """Call ``fn(start, stop)`` on consecutive spans of ``range(n)`` of :data:`SERIAL_CHUNK` elements.

    ``parallel``: shared out to threads as in :func:`chunked` (``fn`` must then touch nothing but its span).
    """
    workers = min(4, torch.get_num_threads(), -(-n // SERIAL_CHUNK)) if parallel else 1
    if workers <= 1:
        with torch_threads(1):
            for s in range(0, n, SERIAL_CHUNK):
                fn(s, min(n, s + SERIAL_CHUNK))
        return
    starts = iter(range(0, n, SERIAL_CHUNK))
    lock = threading.Lock()

    def run() -> None:
        with torch_threads(1):  # this thread's own count: the others' stay as they are
            while True:
                with lock:
                    s = next(starts, None)
                if s is None:
                    return
                fn(s, min(n, s + SERIAL_CHUNK))

    futures = [_pool().submit(run) for _ in range(workers - 1)]
    try:
        run()  # the calling thread takes chunks too
    finally:
        for f in futures:
            f.result()


def chunked_sum(t: torch.Tensor) -> float:
    """The sum of a tensor's elements (float64 accumulation), summed chunk by chunk as :func:`chunked` passes run.

    For finiteness checks between BLAS calls: torch's own ``sum`` of a large tensor runs on all cores and leaves
    their threads spinning into the next BLAS call (a (3072, 3072) solve: 70 ms instead of 62 here).
    """
    flat = t.detach().reshape(-1) if t.is_contiguous() else t.detach().contiguous().view(-1)
    if flat.device.type != "cpu":
        return float(flat.sum(dtype=torch.float64))
    parts: list[torch.Tensor] = []
    lock = threading.Lock()

    def one(s: int, e: int) -> None:
        part = flat[s:e].sum(dtype=torch.float64)
        with lock:
            parts.append(part)

    spans(one, flat.numel(), parallel=True)
    return float(torch.stack(parts).sum()) if parts else 0.0


@functools.cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(3, thread_name_prefix="symfuse-chunks")


_CHUNK_BUFFERS = threading.local()  # per thread: reusable chunk buffers by key and dtype


def chunk_buffer(key: object, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """The calling thread's reusable buffer ``key`` of ``numel`` elements of ``dtype`` (contents undefined)."""
    bufs = getattr(_CHUNK_BUFFERS, "bufs", None)
    if bufs is None:
        bufs = _CHUNK_BUFFERS.bufs = {}
    buf = bufs.get((key, dtype))
    if buf is None or buf.numel() < numel:
        buf = bufs[key, dtype] = torch.empty(max(numel, SERIAL_CHUNK), dtype=dtype)
    return buf[:numel]


class Chunks:
    """K tensors read chunk by chunk (flat spans ``[s, e)``), for one fused pass over all of them.

    A tensor of a :class:`LazyTensors` that can read spans is read from its file a span at a time into a
    per-thread buffer (so it never passes through memory whole, and the chunk is still in cache when used);
    any other is loaded whole once (``pool``'s slot ``{slot}{i}``) and its chunks are views. Reads are
    unchecked: a caller checks what it doubts (a NaN / inf propagates into its result).

    Args:
        tensors: K tensors (plain or :class:`LazyTensors`).
        pool: Buffers for tensors loaded whole (None: new memory).
        slot: Slot prefix in ``pool`` and buffer key prefix.
        dtype: Convert each chunk to this dtype (None: as stored).

    Attributes:
        shapes: The K shapes.
        stored: The K stored dtypes.
        numel: Elements of the first tensor.
    """

    def __init__(
        self, tensors: Sequence[torch.Tensor], pool: BufferPool | None, slot: str, dtype: torch.dtype | None = None
    ):
        self.shapes: list[tuple[int, ...]] = []
        self.stored: list[torch.dtype] = []
        self._reads: list[Callable[[int, int, object], torch.Tensor]] = []
        self._slot, self._dtype = slot, dtype
        lazy = isinstance(tensors, LazyTensors)
        for i in range(len(tensors)):
            span = tensors.span(i) if lazy else None  # type: ignore[union-attr]
            if span is not None:
                shape, stored, read_span = span
                self._reads.append(functools.partial(self._from_file, stored, read_span))
            else:
                t = tensors.load_unchecked(i, pool, f"{slot}{i}") if lazy else tensors[i]  # type: ignore[union-attr]
                shape, stored = tuple(t.shape), t.dtype
                self._reads.append(functools.partial(self._from_memory, t.contiguous().view(-1)))
            self.shapes.append(tuple(shape))
            self.stored.append(stored)
        self.numel = math.prod(self.shapes[0]) if self.shapes else 0

    def _convert(self, chunk: torch.Tensor, key: object) -> torch.Tensor:
        if self._dtype is None or chunk.dtype == self._dtype:
            return chunk
        return chunk_buffer((self._slot, key, "as"), self._dtype, chunk.numel()).copy_(chunk)

    def _from_file(self, stored: torch.dtype, read_span: Callable, s: int, e: int, key: object) -> torch.Tensor:
        buf = chunk_buffer((self._slot, key), stored, e - s)
        read_span(buf, s)
        return self._convert(buf, key)

    def _from_memory(self, flat: torch.Tensor, s: int, e: int, key: object) -> torch.Tensor:
        return self._convert(flat[s:e], key)

    def read(self, i: int, s: int, e: int, key: object = None) -> torch.Tensor:
        """Elements ``[s, e)`` of tensor ``i`` (flat), valid until this thread reads again with the same ``key``.

        ``key`` (default ``i``) names the per-thread buffer: a pass that is done with one tensor's chunk before it
        reads the next may share one key between them and keep its working set in cache.
        """
        return self._reads[i](s, e, i if key is None else key)

    def __call__(self, s: int, e: int) -> list[torch.Tensor]:
        """Elements ``[s, e)`` of every tensor (own buffers), valid until this thread's next call."""
        return [r(s, e, i) for i, r in enumerate(self._reads)]


def acc_dtype(t: torch.Tensor | torch.dtype) -> torch.dtype:
    """Accumulation dtype for elementwise merging: float64 for float64 inputs (or dtype), else float32.

    A weighted sum of K float32 values in float32 is accurate to a few ulps; float64 copies of a large embedding
    matrix would double the merge's peak memory.
    """
    return torch.float64 if (t if isinstance(t, torch.dtype) else t.dtype) == torch.float64 else torch.float32


def weighted_mean(tensors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """``sum_i w_i t_i`` (weights already sum to 1), returned in the inputs' dtype.

    Tensors that can be read in spans (:class:`Chunks`) are summed in one fused pass, chunk by chunk in cache;
    others one model at a time (one tensor in memory besides the sum).
    """
    if len(weights) != len(tensors):
        raise ValueError(f"weighted_mean: {len(tensors)} tensors but {len(weights)} weights")
    lazy = isinstance(tensors, LazyTensors)
    if lazy and all(tensors.span(i) is not None for i in range(len(tensors))):  # type: ignore[union-attr]
        chunks = Chunks(tensors, None, "mean")
        out = torch.empty(chunks.shapes[0], dtype=chunks.stored[0])
        flat, dt = out.view(-1), acc_dtype(chunks.stored[0])

        def one(s: int, e: int) -> None:
            acc = chunk_buffer("mean.acc", dt, e - s).zero_()
            for i, w in enumerate(weights):
                acc.add_(chunks.read(i, s, e, "x"), alpha=w)
            flat[s:e].copy_(acc)

        spans(one, chunks.numel, parallel=True)
        return out
    first = tensors[0]
    dt = acc_dtype(first)
    acc = torch.zeros(first.shape, dtype=dt, device=first.device)
    for t, w in zip(tensors, weights, strict=True):
        chunked(lambda a, x, w=w: a.add_(x, alpha=w), acc, t.contiguous())
    return acc.to(first.dtype)
