"""Two-model methods: one tensor pair at a time.

:class:`TwoModelMerger` (nuslerp, arcee-fusion) and :class:`PairMerger`, whose one parameter ``t`` may be a gradient
over the layers (slerp, nearswap).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from symfuse.merge.base import Merger, TensorInputs, load_all
from symfuse.merge.gradient import LayerGradient


class TwoModelMerger(Merger):
    """:meth:`merge_pair` on each tensor of exactly two models; a part only one model holds is that model's.

    Subclasses set ``name``, ``Params`` and :meth:`merge_pair`.
    """

    model_count = (2, 2)

    def merge_pair(self, t: TensorInputs, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
        """The method on one tensor pair (``t``: the inputs, for their name, weights and base)."""
        raise NotImplementedError

    def merge_tensor(self, t: TensorInputs) -> torch.Tensor:
        """:meth:`merge_pair` of the two models' tensors."""
        if len(t.tensors) == 1:  # one model holds this part (a head row): mergekit returns it
            return t.tensors[0].clone()
        self.check_model_count(len(t.tensors))
        first, second = load_all(t.tensors, self.pool, self.name, None)  # both valid at once
        return self.merge_pair(t, first, second)


class PairMerger(TwoModelMerger):
    """``combine(t, first, second)`` per tensor, ``t`` (``params.t``) read at the tensor's layer.

    Subclasses set ``name``, ``Params`` (with ``t``) and :meth:`combine`.
    """

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

    def merge_pair(self, t: TensorInputs, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
        """:meth:`combine` with ``t`` read at this tensor's layer."""
        value = self.gradient.value(self.params.t, t.name, f"{self.name} t")  # type: ignore[attr-defined]
        return self.combine(value, first, second)
