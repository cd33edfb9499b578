"""Passthrough: one model's tensors, optionally scaled (mergekit's ``passthrough`` without layer slices).

Layer slices (stacking layers of several models) belong to the merge YAML; this strategy takes exactly one model
and returns its tensors, times ``scale`` when given.

Source: mergekit 0.1.5, ``mergekit/merge_methods/passthrough.py`` ``PassthroughMergeTask.execute`` (exactly one
tensor; the per-model ``scale`` parameter multiplies it).
"""

from __future__ import annotations

import torch
from pydantic import Field

from symfuse.merge.base import Merger, TensorInputs
from symfuse.merge.registry import UnweightedParams


def passthrough(x: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """A new copy of ``x``, times ``scale`` when given (same dtype and device)."""
    return x.clone() if scale is None else (x * scale).to(x.dtype)


class PassthroughParams(UnweightedParams):
    """Passthrough parameters (mergekit's names)."""

    scale: float | None = Field(default=None, allow_inf_nan=False)  # multiply every tensor (None: as stored)


class PassthroughMerger(Merger):
    """The one model's tensors (times ``scale``)."""

    name = "passthrough"
    model_count = (1, 1)
    propagates_nonfinite = True
    Params = PassthroughParams

    def merge_tensor(self, t: TensorInputs) -> torch.Tensor:
        """The model's tensor (times ``scale``)."""
        self.check_model_count(len(t.tensors))
        return passthrough(t.tensors[0], self.params.scale)  # type: ignore[attr-defined]
