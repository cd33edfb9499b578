"""Model Stock (Jang et al., 2024): the fine-tuned average pulled towards the base by the task vectors' angle.

With N fine-tuned tensors ``w_i`` and the base ``w_0``: ``cos`` is the mean of the pairwise cosines between the
task vectors ``w_i - w_0`` (norm products floored at 1e-6, each cosine clamped to [-1, 1]), the ratio
``t = N cos / (1 + (N - 1) cos)``, and ``w = t mean_i(w_i) + (1 - t) w_0``. ``filter_wise``: one cosine and one
ratio per row (the last axis is the vector; a 1-D tensor is one row), else one for the flattened tensor.
Identical task vectors give ``t = 1`` (the fine-tuned average), orthogonal ones ``t = 0`` (the base).

Source: mergekit 0.1.5, ``mergekit/merge_methods/model_stock.py`` ``ModelStockMergeTask.execute``. mergekit
computes in the inputs' dtype; here in float32 (float64 for float64 inputs).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from symfuse.merge.base import Merger, TensorInputs, acc_dtype, load_all
from symfuse.merge.registry import UnweightedParams


def model_stock_ratio(offsets: Sequence[torch.Tensor]) -> torch.Tensor:
    """``t = N cos / (1 + (N - 1) cos)`` from the mean pairwise cosine of N >= 2 task vectors along the last axis.

    Returns:
        The ratio with the last axis kept (size 1), in the offsets' dtype.
    """
    cosines = []
    for i, a in enumerate(offsets):
        for b in offsets[i + 1 :]:
            norms = torch.linalg.vector_norm(a, dim=-1) * torch.linalg.vector_norm(b, dim=-1)
            cosines.append(((a * b).sum(dim=-1) / norms.clamp(min=1e-6)).clamp(-1, 1))
    cos = torch.stack(cosines).mean(dim=0).unsqueeze(-1)
    n = len(offsets)
    return (n * cos) / (1 + (n - 1) * cos)


def model_stock(tensors: Sequence[torch.Tensor], base: torch.Tensor, filter_wise: bool = False) -> torch.Tensor:
    """Model Stock of N >= 2 fine-tuned tensors around ``base``.

    Args:
        tensors: The N fine-tuned tensors.
        base: The base (pre-trained) tensor.
        filter_wise: One ratio per row (last axis) instead of one per tensor.

    Returns:
        A new tensor of ``base``'s shape, in the fine-tuned tensors' dtype, on their device.

    Raises:
        ValueError: fewer than two fine-tuned tensors.
    """
    if len(tensors) < 2:
        raise ValueError(f"model-stock: {len(tensors)} fine-tuned tensor(s) — it needs two or more besides the base")
    dt = acc_dtype(tensors[0])
    w0 = base.to(dt)
    ws = [w.to(dt) for w in tensors]
    if not filter_wise:
        w0, ws = w0.reshape(-1), [w.reshape(-1) for w in ws]
    elif w0.dim() == 1:  # a bias: one row
        w0, ws = w0.unsqueeze(0), [w.unsqueeze(0) for w in ws]
    t = model_stock_ratio([w - w0 for w in ws])
    avg = torch.stack(ws).mean(dim=0)
    return (t * avg + (1 - t) * w0).reshape(base.shape).to(tensors[0].dtype)


class ModelStockParams(UnweightedParams):
    """Model Stock parameters (mergekit's names)."""

    filter_wise: bool = False  # one ratio per row instead of one per tensor


class ModelStockMerger(Merger):
    """Model Stock: the fine-tuned average pulled towards the base by the task vectors' mean cosine."""

    name = "model-stock"
    needs_base = True
    Params = ModelStockParams

    def merge_tensor(self, t: TensorInputs) -> torch.Tensor:
        """``model_stock`` of the K tensors around the base (one model's part: that model's tensor)."""
        self.check_inputs(t)
        assert t.base is not None
        if len(t.tensors) == 1:  # one model holds this part (a head row)
            return t.tensors[0].clone()
        xs = load_all(t.tensors, self.pool, "model-stock", None)
        return model_stock(xs, t.base, self.params.filter_wise)  # type: ignore[attr-defined]
