"""The per-tensor loop of a merge: one stored tensor of the K models (with its statistics) in, the merged one out.

:class:`TensorMerge` is the ``replace`` function :func:`symfuse.checkpoint.write_checkpoint` calls for every tensor
of model 0, in storage order. On the CPU the K tensors are read into reused buffers, and a merger whose every input
enters a sum reads them unchecked, span by span in one fused pass, checking them only when its output is not finite
(to name the file). On a device one tensor of the K models is moved there at a time and merged with whole-tensor ops.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from symfuse.checkpoint import CheckpointReader
from symfuse.errors import MissingStats, NonFiniteError, StatsMismatchError
from symfuse.io import BufferPool, check_finite_tensor
from symfuse.merge.base import LazyTensors, Merger, TensorInputs, chunked_sum, weighted_mean
from symfuse.merge.gram_systems import check_gram_diagonal
from symfuse.merge.heads import merge_class_rows
from symfuse.merge.plan import MergePlan
from symfuse.merge.readers import counterpart
from symfuse.stats.io import StatsFile


def _all_finite(t: torch.Tensor) -> bool:
    """Whether every element is finite (one reduction; element-wise only when the sum is not finite)."""
    return math.isfinite(chunked_sum(t)) or bool(torch.isfinite(t).all())


def _finite_loader(
    load: Callable[[BufferPool | None, str], torch.Tensor], name: str, where: Path
) -> Callable[[BufferPool | None, str], torch.Tensor]:
    """``load`` whose result is checked for NaN / inf (naming ``where`` and ``name``) before any maths sees it."""
    return lambda p, s: check_finite_tensor(load(p, s), name, where)


def _fisher_loader(
    load: Callable[[BufferPool | None, str], torch.Tensor], name: str, where: Path, peaks: dict[Path, float]
) -> Callable[[BufferPool | None, str], torch.Tensor]:
    """``load`` of a diagonal Fisher, refused when it holds a negative entry (a mean of squares never does).

    ``peaks[where]`` keeps the largest entry read from the file so far (see :meth:`TensorMerge.check_fishers`).
    """

    def checked(pool: BufferPool | None, slot: str) -> torch.Tensor:
        t = load(pool, slot)
        low, high = (float(v) for v in torch.aminmax(t)) if t.numel() else (0.0, 0.0)
        peaks[where] = max(peaks.get(where, 0.0), high)
        if low < 0:
            raise StatsMismatchError(
                f"{where}: the Fisher of {name} has negative entries (as low as {low:.3g}); a diagonal Fisher is a "
                "mean of squared gradients — recollect it with `symfuse stats MODEL --data DATA --kind fisher`"
            )
        return t

    return checked


_RECOLLECT = "`symfuse stats MODEL --data DATA --kind gram`"


def _check_gram_shapes(grams: Sequence[StatsFile], module: str, inputs: int) -> None:
    """Each Gram of ``module`` is ``inputs x inputs`` (headers only), else refused naming its file."""
    for g in grams:
        shape = tuple(g.shape(module))
        if shape != (inputs, inputs):
            raise StatsMismatchError(f"{g.path}: the Gram of {module} has shape {list(shape)}, but the layer reads "
                                     f"{inputs} inputs — recollect it: {_RECOLLECT}")  # fmt: skip


def _gram_inputs(
    grams: Sequence[StatsFile],
    module: str,
    pool: BufferPool | None,
    to_dev: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
) -> LazyTensors:
    """The K Grams of ``module`` (checked finite, with a diagonal >= 0, on access; RegMean checks its own way).

    On the CPU (``pool`` given) they can also be read in spans; elsewhere each is read whole and moved by ``to_dev``.
    """
    return LazyTensors(
        [lambda p, s, g=g: to_dev(g.get(module, p, s)) for g in grams],
        pool,
        "gram",
        checks=[
            lambda t, g=g: check_gram_diagonal(check_finite_tensor(t, module, g.path), module, g.path) for g in grams
        ],
        spans=[(g.shape(module), g.dtype(module), lambda o, f, g=g: g.read_span(module, o, f)) for g in grams]
        if pool is not None
        else None,
    )


def _tensor_spans(name: str, first: torch.Tensor, others: Sequence[CheckpointReader]) -> list:
    """Spans of K models' tensor ``name`` (see :class:`LazyTensors`), unchecked: model 0's from ``first``."""
    flat = first.detach().contiguous().view(-1)
    spans = [(tuple(first.shape), first.dtype, lambda o, f: o.copy_(flat[f : f + o.numel()]))]
    for r in others:
        tf = r.tensor_file(name)
        spans.append((tf.shape(name), tf.dtype(name), lambda o, f, tf=tf: tf.read_span(name, o, f)))
    return spans


class TensorMerge:
    """``replace(name, tensor)`` for :func:`~symfuse.checkpoint.write_checkpoint`: model 0's tensor -> the merged."""

    def __init__(self, plan: MergePlan, on_progress: Callable[[float], None] | None = None):
        """``on_progress``: called with the fraction of model 0's elements merged after every tensor (or None)."""
        self.plan = plan
        self.r0 = plan.readers[0]
        dev = plan.device
        self.to_dev: Callable[[torch.Tensor], torch.Tensor] = (lambda t: t) if plan.on_cpu else (lambda t: t.to(dev))
        self.on_progress = on_progress
        self.done, self.total = 0, max(1, sum(math.prod(self.r0.shape(n)) for n in self.r0.names()))
        self.fisher_peaks: dict[Path, float] = {}  # Fisher file -> its largest entry read

    def check_fishers(self) -> None:
        """Refuse a Fisher file whose every entry read was zero: the merge gave its model no say anywhere."""
        for where, peak in self.fisher_peaks.items():
            if peak == 0:
                raise StatsMismatchError(
                    f"{where}: every Fisher entry is zero, so the Fisher merge would ignore its model — recollect "
                    "it on data the model was trained on: `symfuse stats MODEL --data DATA --kind fisher`"
                )

    def __call__(self, name: str, first: torch.Tensor) -> torch.Tensor:
        """The merged tensor ``name`` (in host memory), its inputs and output checked finite."""
        plan, merger = self.plan, self.plan.merger
        rows = plan.union is not None and plan.union.per_class(name, first.shape, plan.heads)  # per class
        # a merger whose every input enters a sum carries any NaN / inf into its output: its inputs are read
        # unchecked, and checked (to name the file) only when the output is not finite
        kept = plan.separate and name in plan.heads
        deferred = plan.on_cpu and merger.propagates_nonfinite and first.is_floating_point() and not rows and not kept
        if not deferred:
            check_finite_tensor(first, name, self.r0.file_of(name))
        merged = self._merge(name, first, rows, deferred)
        finite = merger.output_finite(merged)  # known when the merger's last pass took the output's sum
        if plan.out_dtype is not None and merged.is_floating_point() and merged.dtype != plan.out_dtype:
            # cast here, where it is checked: the writer's cast wrote inf past float16's range (exit 0); a cast to a
            # narrower range is checked again, a widening one keeps what the merger knew
            finite = finite and torch.finfo(plan.out_dtype).max >= torch.finfo(merged.dtype).max
            merged = merged.to(plan.out_dtype)
        finite = finite or _all_finite(merged)
        if merged is not first and merged.is_floating_point() and not finite:
            if deferred:
                self._name_the_bad_input(name, first)
            narrow = " (float16 holds |values| up to 65504: write float32 or bfloat16 with --out-dtype)"
            raise NonFiniteError(
                f"{plan.out}: merged tensor {name!r} came out NaN / inf with {plan.strategy} (inputs were finite)"
                f"{narrow if merged.dtype == torch.float16 else ''} — nothing was written; try "
                f"{_overflow_fix(merger)}another strategy"
            )
        self.done += first.numel()
        if self.on_progress is not None:
            self.on_progress(min(1.0, self.done / self.total))
        return merged if plan.on_cpu else merged.cpu()

    def _name_the_bad_input(self, name: str, first: torch.Tensor) -> None:
        """Raise naming the input file that carried a NaN / inf into the output (deferred checks)."""
        fishers = self.plan.files.get("fisher")
        check_finite_tensor(first, name, self.r0.file_of(name))
        for r in self.plan.readers[1:]:
            check_finite_tensor(r.get(name), name, r.file_of(name))
        for f in fishers if fishers is not None and all(f.has(name) for f in fishers) else []:
            check_finite_tensor(f.get(name), name, f.path)

    def _base(self, name: str, first_shape: torch.Size) -> torch.Tensor | None:
        b = self.plan.base_reader
        if b is None:
            return None
        bname = counterpart(name, self.r0, b)
        if not b.has(bname) or b.shape(bname) != tuple(first_shape):  # e.g. a base with another task head
            return None
        return self.to_dev(check_finite_tensor(b.get(bname), bname, b.file_of(bname)))

    def _merge(self, name: str, first: torch.Tensor, rows: bool, deferred: bool) -> torch.Tensor:
        plan, merger, to_dev = self.plan, self.plan.merger, self.to_dev
        if (plan.separate and name in plan.heads) or not first.is_floating_point():
            return first  # kept heads, and integer / bool tensors, pass through untouched
        checked = (lambda load, where: load) if deferred else (lambda load, where: _finite_loader(load, name, where))
        pool = merger.pool
        tensors = LazyTensors(
            [lambda p, s: p.take(s, first.shape, first.dtype).copy_(first) if p is not None else to_dev(first.clone())]
            + [checked(lambda p, s, r=r: to_dev(r.get(name, p, s)), r.file_of(name)) for r in plan.readers[1:]],
            pool,
            "tensor",
            spans=_tensor_spans(name, first, plan.readers[1:]) if deferred else None,  # unchecked: only when deferred
        )
        b = self._base(name, first.shape)
        if merger.needs_base and b is None:  # e.g. a head absent from a bare base model
            merger.count("no_base_averaged")
            if rows:
                mean = lambda t: weighted_mean(t.tensors, t.weights)  # noqa: E731
                return merge_class_rows(mean, TensorInputs(name, tensors, plan.weights), plan.learned)
            return weighted_mean(tensors, plan.weights)
        fisher = self._fisher(name, checked)
        gram, conv1d, key = self._grams(name, first)
        inputs = TensorInputs(name, tensors, plan.weights, b, fisher, gram, conv1d, key)
        return merge_class_rows(merger.merge_tensor, inputs, plan.learned) if rows else merger.merge_tensor(inputs)

    def _fisher(self, name: str, checked: Callable) -> LazyTensors | None:
        fishers = self.plan.files.get("fisher")
        if fishers is None or not all(f.has(name) for f in fishers):
            return None
        loads = [
            _fisher_loader(
                checked(lambda p, s, f=f: self.to_dev(f.get(name, p, s)), f.path), name, f.path, self.fisher_peaks
            )
            for f in fishers
        ]
        return LazyTensors(loads, self.plan.merger.pool, "fisher")

    def _grams(self, name: str, first: torch.Tensor) -> tuple[Sequence[torch.Tensor] | None, bool, str | None]:
        """The K input Grams of a linear weight (files, else the merger's own), its Conv1D flag and Gram key."""
        grams, merger = self.plan.files.get("gram"), self.plan.merger
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if module is None or first.dim() != 2:
            return None, False, None
        gram, conv1d = None, False
        if grams is not None:
            have = [g.has(module) for g in grams]
            if all(have):
                conv1d = module in grams[0].conv1d
                _check_gram_shapes(grams, module, first.shape[0] if conv1d else first.shape[1])
                gram = _gram_inputs(grams, module, merger.pool, self.to_dev)
            elif any(have):
                lacking = next(g.path for g, h in zip(grams, have, strict=True) if not h)
                raise MissingStats(f"{lacking}: no Gram of {module}, which the other models' statistics hold — "
                                   f"recollect it: {_RECOLLECT}")  # fmt: skip
        if gram is None:
            gram = merger.supplied_grams(module)  # Grams the merger collected itself (RegMean++'s tail)
        key = self.plan.same_input.get(module, module) if gram is not None else None
        return gram, conv1d, key


# the parameters that bring a merge's values back into range, and which way (only those the strategy has)
_OVERFLOW_TIPS = {"dtype": "--dtype float64", "alpha": "a smaller --alpha", "lam": "a smaller --lam"}


def _overflow_fix(merger: Merger) -> str:
    """``"<tip>, <tip>, or "`` for a merged tensor that overflowed: the strategy's own parameters (empty: none)."""
    fields = type(merger).Params.model_fields
    tips = [tip for field, tip in _OVERFLOW_TIPS.items() if field in fields]
    if merger.name == "fisher":
        tips.append("a larger --epsilon")
    return "".join(f"{t}, " for t in tips) + ("or " if tips else "")
