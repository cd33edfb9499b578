"""SCE (Wan et al., 2024, FuseChat): select, calculate, erase, as mergekit 0.1.5's ``sce``.

With task vectors ``tau_i``:

* select: keep the ``select_topk`` fraction of entries (of those whose variance across the K models is not 0) with
  the largest variance across the models, in every task vector (1: all);
* calculate: model ``i``'s weight is the mean of its selected ``tau_i ** 2``, normalised to sum 1 (uniform when
  the sum is below 1e-6);
* erase: per entry, only the task vectors whose sign is the majority's (the sign of their sum, ``+`` at 0) count;
  ``theta = base + sum_i w_i tau_i [agrees] / max(sum_i w_i [agrees], 1e-6)``.

The model weights play no part (as in mergekit): unequal ``weights`` are refused.
"""

from __future__ import annotations

import torch
from pydantic import Field, model_validator

from symfuse.merge.base import MergeParams, Merger, TensorInputs
from symfuse.merge.task_vectors import task_vectors


def sce_select(stacked: torch.Tensor, topk: float) -> torch.Tensor:
    """Boolean mask (one tensor's shape) of the ``topk`` fraction of entries of largest variance across models."""
    shape = stacked.shape[1:]
    if topk >= 1:
        return torch.ones(shape, dtype=torch.bool, device=stacked.device)
    var = stacked.var(0, unbiased=False)
    k = int(torch.count_nonzero(var) * topk)  # torch's float32 product, as mergekit computes it
    keep = torch.zeros(var.numel(), dtype=torch.bool, device=stacked.device)
    if k > 0:
        keep[torch.topk(var.abs().reshape(-1), k=k, largest=True).indices] = True
    return keep.view(shape)


def sce_weights(stacked: torch.Tensor) -> torch.Tensor:
    """Per-model weights: mean square of each task vector, normalised to sum 1 (uniform when they sum below 1e-6)."""
    w = stacked.square().reshape(stacked.shape[0], -1).mean(1)
    total = float(w.sum())
    return torch.full_like(w, 1.0 / w.numel()) if abs(total) < 1e-6 else w / total


def sce_combine(taus: list[torch.Tensor], topk: float) -> torch.Tensor:
    """The merged task vector: select, calculate, erase."""
    stacked = torch.stack(taus)  # (K, ...)
    stacked = torch.where(sce_select(stacked, topk), stacked, torch.zeros_like(stacked))
    majority = torch.where(stacked.sum(0) >= 0, 1.0, -1.0).to(stacked.dtype)
    w = sce_weights(stacked).view(-1, *([1] * (stacked.dim() - 1)))
    erased = torch.where(torch.sign(stacked) == majority, w.expand_as(stacked), torch.zeros_like(stacked))
    return (stacked * erased).sum(0) / erased.sum(0).clamp(min=1e-6)


class SceParams(MergeParams):
    """SCE parameters (mergekit's)."""

    select_topk: float = Field(default=1.0, gt=0, le=1)  # fraction of entries kept, by variance across models
    int8_mask: bool = False  # mergekit's mask storage switch: accepted, no effect (masks are bool here)

    @model_validator(mode="after")
    def _no_weights(self) -> SceParams:
        if self.weights is not None and len(set(self.weights)) > 1:
            raise ValueError("sce weighs each model by its task vector's mean square: weights do not apply — drop them")
        return self


class SceMerger(Merger):
    """Select, calculate, erase (needs the base model)."""

    name = "sce"
    needs_base = True
    Params = SceParams

    def merge_tensor(self, t: TensorInputs) -> torch.Tensor:
        """Base plus the SCE task vector, in model 0's dtype."""
        self.check_inputs(t)
        assert t.base is not None
        tau = sce_combine(task_vectors(t), self.params.select_topk)  # type: ignore[attr-defined]
        return (t.base.to(torch.float64) + tau).to(t.tensors[0].dtype)
