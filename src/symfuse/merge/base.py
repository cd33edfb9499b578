"""The merger plug-in interface: one tensor (from K models, with its statistics) in, one merged tensor out."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict

from symfuse.errors import MissingStats


class MergeParams(BaseModel):
    """Parameters shared by every merger; subclasses add their own (unknown keys are an error)."""

    model_config = ConfigDict(extra="forbid")

    weights: list[float] | None = None  # per-model weights (normalised to sum 1); default uniform


class LazyTensors(Sequence[torch.Tensor]):
    """K tensors loaded on access (each access reads again), so a merger that walks them once holds one at a time.

    Args:
        loaders: One zero-argument function per model returning its tensor.
    """

    def __init__(self, loaders: Sequence[Callable[[], torch.Tensor]]):
        self._loaders = list(loaders)

    def __len__(self) -> int:
        return len(self._loaders)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [f() for f in self._loaders[i]]
        return self._loaders[i]()


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
    """

    name: str
    tensors: Sequence[torch.Tensor]
    weights: Sequence[float]
    base: torch.Tensor | None = None
    fisher: Sequence[torch.Tensor] | None = None
    gram: Sequence[torch.Tensor] | None = None
    conv1d: bool = False


class Merger:
    """Base of the registered mergers.

    Subclasses set ``name``, ``required_stats`` (kinds of :mod:`symfuse.stats` files they read), ``needs_base``,
    a pydantic ``Params`` class, and implement :meth:`merge_tensor`, which must return a NEW tensor and never
    modify its inputs.
    """

    name: ClassVar[str]
    required_stats: ClassVar[frozenset[str]] = frozenset()
    needs_base: ClassVar[bool] = False
    Params: ClassVar[type[MergeParams]] = MergeParams

    def __init__(self, **params: Any):
        self.params = self.Params(**params)
        self.counters: dict[str, int] = {}

    def count(self, what: str) -> None:
        """Count an event for the merge report (e.g. ``lstsq_fallback``)."""
        self.counters[what] = self.counters.get(what, 0) + 1

    def model_weights(self, k: int) -> list[float]:
        """The K normalised model weights."""
        w = self.params.weights or [1.0] * k
        if len(w) != k or sum(w) <= 0 or min(w) < 0:
            raise ValueError(f"{self.name}: weights {w} must be {k} non-negative numbers with a positive sum")
        s = float(sum(w))
        return [float(x) / s for x in w]

    def merge_tensor(self, t: TensorInputs) -> torch.Tensor:
        """Merge one tensor of K models."""
        raise NotImplementedError

    def check_inputs(self, t: TensorInputs) -> None:
        """Raise a clear error if the tensor lacks what this merger needs."""
        if self.needs_base and t.base is None:
            raise MissingStats(f"{self.name}: no base tensor for {t.name}; pass --base")


def acc_dtype(t: torch.Tensor) -> torch.dtype:
    """Accumulation dtype for elementwise merging: float64 for float64 inputs, else float32.

    A weighted sum of K float32 values in float32 is accurate to a few ulps; float64 copies of a large embedding
    matrix would double the merge's peak memory.
    """
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def weighted_mean(tensors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """``sum_i w_i t_i`` (weights already sum to 1), returned in the inputs' dtype."""
    dt = acc_dtype(tensors[0])
    acc = torch.zeros(tensors[0].shape, dtype=dt)
    for t, w in zip(tensors, weights, strict=True):
        acc.add_(t.to(dt), alpha=w)
    return acc.to(tensors[0].dtype)
