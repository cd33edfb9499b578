"""Two-model methods whose one parameter ``t`` may be a gradient over the layers (slerp, nearswap)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from symfuse.merge.base import Merger, TensorInputs, load_all
from symfuse.merge.gradient import LayerGradient


class PairMerger(Merger):
    """``combine(t, first, second)`` per tensor, ``t`` (``params.t``) read at the tensor's layer.

    Subclasses set ``name``, ``Params`` (with ``t``) and :meth:`combine`.
    """

    model_count = (2, 2)

    def __init__(self, **params: Any):
        super().__init__(**params)
        self.gradient = LayerGradient()

    def prepare(self, models: Sequence[Any], keep: frozenset[str] = frozenset()) -> None:
        """Read the layer count when ``t`` is a gradient over the layers."""
        if isinstance(self.params.t, list):  # type: ignore[attr-defined]
            self.gradient.prepare([Path(m) for m in models])

    def combine(self, t: float, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
        """The method on one tensor pair."""
        raise NotImplementedError

    def merge_tensor(self, t: TensorInputs) -> torch.Tensor:
        """:meth:`combine` with ``t`` read at this tensor's layer."""
        if len(t.tensors) == 1:  # one model holds this part (a head row): mergekit returns it
            return t.tensors[0].clone()
        self.check_model_count(len(t.tensors))
        a, b = load_all(t.tensors, self.pool, self.name, None)  # both valid at once
        value = self.gradient.value(self.params.t, t.name, f"{self.name} t")  # type: ignore[attr-defined]
        return self.combine(value, a, b)
