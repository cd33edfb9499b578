"""Arcee Fusion: keep the second model's changes where they matter most (mergekit's ``arcee_fusion``).

With ``a`` the first ``--models`` entry (mergekit's ``base_model``) and ``b`` the second: the importance of each
entry is ``|b - a|`` times the KL divergence ``sum p log(p / q)`` of ``p = softmax(b) + 1e-8`` from
``q = softmax(a) + 1e-8`` along the last axis (one value per row, a 1-D tensor is one row). The threshold is
``median + 1.5 IQR`` of the importances, each quantile the sorted importances' entry at ``int(q (n - 1))``; the
result is ``a + (b - a)`` where the importance reaches the threshold, ``a`` elsewhere.

Source: mergekit 0.1.5, ``mergekit/merge_methods/arcee_fusion.py``: ``ArceeFusionMergeTask._compute_importance``
and ``execute``, ``DynamicThresholdFusion`` (``approximate_quantiles``, ``calculate_dynamic_threshold``,
``compute_fusion_mask``). Differences: mergekit takes the quantiles of a random sample of 1,000,000 importances
when a tensor has more (a different mask on every run); here always of all of them (exact, reproducible); and
computes the importances and the threshold in float64 (so that a GPU and a CPU agree on the mask, but for float64
ties) and the result in float32 (float64 for float64 inputs), where mergekit uses the inputs' dtype.
"""

from __future__ import annotations

import torch

from symfuse.merge.base import TensorInputs, acc_dtype
from symfuse.merge.pairwise import TwoModelMerger
from symfuse.merge.registry import UnweightedParams


def fusion_importance(b: torch.Tensor, a: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``|b - a| * KL(softmax(b) + eps || softmax(a) + eps)`` along the last axis (broadcast over each row)."""
    p = torch.softmax(b, dim=-1) + eps
    q = torch.softmax(a, dim=-1) + eps
    kl = (p * torch.log(p / q)).sum(dim=-1)
    return (b - a).abs() * kl.unsqueeze(-1)


def sorted_quantile(values: torch.Tensor, q: float) -> torch.Tensor:
    """The entry at ``int(q * (n - 1))`` of the sorted flattened ``values`` (mergekit's quantile, no sampling)."""
    flat = values.reshape(-1)
    return flat.kthvalue(int(q * (flat.numel() - 1)) + 1).values


def fusion_threshold(importance: torch.Tensor) -> torch.Tensor:
    """``median + 1.5 (q3 - q1)`` of the importances."""
    median = sorted_quantile(importance, 0.5)
    q1, q3 = sorted_quantile(importance, 0.25), sorted_quantile(importance, 0.75)
    return median + 1.5 * (q3 - q1)


def arcee_fusion(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a`` plus ``b - a`` where the importance of the change reaches the dynamic threshold.

    Args:
        a: The base tensor (mergekit's base model).
        b: The other tensor.

    Returns:
        A new tensor of ``a``'s shape, dtype and device.
    """
    dt = acc_dtype(a)
    x, y = a.to(dt), b.to(dt)
    # the mask is a hard decision at the threshold: taken in float64, so that the ulp-level differences of
    # softmax / log between devices (float32 on a GPU against a CPU) do not flip entries at the threshold
    importance = fusion_importance(b.to(torch.float64), a.to(torch.float64))
    mask = importance >= fusion_threshold(importance)
    return (x + (y - x) * mask).to(a.dtype)


class ArceeFusionParams(UnweightedParams):
    """Arcee Fusion has no parameters (as in mergekit)."""


class ArceeFusionMerger(TwoModelMerger):
    """Arcee Fusion of two models: the first plus the second's most important changes."""

    name = "arcee-fusion"
    Params = ArceeFusionParams

    def merge_pair(self, t: TensorInputs, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
        """``arcee_fusion(first, second)``."""
        return arcee_fusion(first, second)
