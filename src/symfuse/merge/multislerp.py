"""Multi-SLERP: barycentric interpolation of K models on the hypersphere (mergekit's ``multislerp``).

Each flattened tensor (a task vector against the optional base) is projected to the unit sphere,
``u_i = x_i / (|x_i| + eps)``; their weighted mean direction ``m`` is the tangent point; the tangent vectors
``u_i - (u_i . m) m`` are averaged with the weights into ``v``, mapped back with the exponential map
``m cos|v| + v sin|v| / |v|`` (``|v|`` plus ``eps``) and scaled by the weighted mean norm ``sum_i w_i |x_i|``.
When the weighted mean of the unit vectors vanishes (``|m| < eps``): two models are interpolated linearly,
``w_0 x_0 + w_1 x_1``; more are refused (mergekit raises) unless every tensor is zero, where the result is the
zero tensor (plus the base).

Source: mergekit 0.1.5, ``mergekit/merge_methods/multislerp.py`` ``multislerp`` (``normalize_weights=True``,
``eps=1e-8``). It computes in the inputs' dtype; here in float32 (float64 for float64 inputs).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from pydantic import Field

from symfuse.merge.base import MergeParams, Merger, TensorInputs, acc_dtype, load_all


def multislerp(
    tensors: Sequence[torch.Tensor],
    weights: Sequence[float],
    base: torch.Tensor | None = None,
    normalize_weights: bool = True,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Weighted spherical barycenter of K tensors (of their task vectors when ``base`` is given).

    Args:
        tensors: K tensors of one shape.
        weights: K weights.
        base: Optional origin of the sphere.
        normalize_weights: Divide the weights by their sum.
        eps: Added to the norms before dividing.

    Returns:
        A new tensor of the first tensor's shape, dtype and device.

    Raises:
        ValueError: three or more non-zero tensors whose weighted unit vectors cancel out.
    """
    first = tensors[0]
    if len(tensors) == 1:
        return first.clone()
    dt = acc_dtype(first)
    x = torch.stack([v.to(dt).reshape(-1) for v in tensors])
    if base is not None:
        x = x - base.to(dt).reshape(1, -1)
    w = torch.tensor(list(weights), dtype=dt, device=x.device)
    if normalize_weights:
        w = w / w.sum()
    norms = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    units = x / (norms + eps)
    mean = (units * w.view(-1, 1)).sum(0)
    mean_norm = torch.linalg.vector_norm(mean)
    if float(mean_norm) < eps:
        if len(tensors) == 2 or float(norms.max()) == 0.0:  # mergekit: linear for two; all zero: zero
            res = (x * w.view(-1, 1)).sum(0)
            return _finish(res, base, first)
        raise ValueError(
            "multislerp: the weighted sum of the unit tensors is zero (antipodal tensors with balancing weights) "
            "— change the weights"
        )
    mean = mean / mean_norm
    tangents = units - (units * mean).sum(-1, keepdim=True) * mean
    tangent = (tangents * w.view(-1, 1)).sum(0)
    tnorm = torch.linalg.vector_norm(tangent) + eps
    res = mean * torch.cos(tnorm) + tangent * (torch.sin(tnorm) / tnorm)
    res = res * (norms.squeeze(-1) * w).sum()
    return _finish(res, base, first)


def _finish(flat: torch.Tensor, base: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """``flat`` in ``like``'s shape, plus ``base`` when given, in ``like``'s dtype."""
    out = flat.reshape(like.shape)
    if base is not None:
        out = out + base.to(out.dtype)
    return out.to(like.dtype)


class MultiSlerpParams(MergeParams):
    """Multi-SLERP parameters (mergekit's names); the model weights come from ``--weights``."""

    normalize_weights: bool = True  # divide the weights by their sum (false: as given)
    eps: float = Field(default=1e-8, gt=0, allow_inf_nan=False)  # added to the norms before dividing


class MultiSlerpMerger(Merger):
    """Spherical barycenter of K models (of their task vectors when a base model is given)."""

    name = "multislerp"
    accepts_base = True
    Params = MultiSlerpParams

    def merge_tensor(self, t: TensorInputs) -> torch.Tensor:
        """``multislerp`` of the K tensors with the model weights."""
        p = self.params
        weights = [float(w) for w in t.weights]  # normalised to sum 1
        if not p.normalize_weights:  # type: ignore[attr-defined]
            raw = self.params.weights or [1.0] * len(weights)
            weights = [w * float(sum(raw)) for w in weights]  # back to the weights as given
        xs = load_all(t.tensors, self.pool, "multislerp", None)
        return multislerp(xs, weights, t.base, p.normalize_weights, p.eps)  # type: ignore[attr-defined]
