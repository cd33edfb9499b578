"""NuSLERP: SLERP of two models with ``t`` from their weights, whole-tensor or row by row (mergekit's ``nuslerp``).

``t = w_1 / (w_0 + w_1)`` from the two model weights (``--weights``; 0.5 when they sum to ~0). ``nuslerp(t, v0,
v1)`` interpolates along the last axis (``nuslerp_row_wise``: along the first, i.e. each column) or over the
flattened tensor (``nuslerp_flatten``, the default): unit vectors ``v / max(|v|, 1e-7)``, ``theta = acos(cos)``,
``(sin((1 - t) theta) v0 + sin(t theta) v1) / sin(theta)``, and ``(1 - t) v0 + t v1`` where ``|sin theta| < 1e-8``.
With a base model (optional) it interpolates the task vectors: ``base + nuslerp(t, v0 - base, v1 - base)``.

Source: mergekit 0.1.5, ``mergekit/merge_methods/nuslerp.py``: ``nuslerp`` and ``NuSlerpTask.execute`` (``t``,
the base model, ``dim=0 if row_wise else -1``). mergekit computes in the inputs' dtype; here in float32 (float64
for float64 inputs), returned in the first model's dtype.
"""

from __future__ import annotations

import torch

from symfuse.merge.base import MergeParams, TensorInputs, acc_dtype
from symfuse.merge.pairwise import TwoModelMerger


def _unit(x: torch.Tensor, eps: float = 1e-7) -> torch.Tensor:
    """``x`` over its last-axis norm, the norm floored at ``eps``."""
    return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp(min=eps)


def nuslerp(
    t: float, v0: torch.Tensor, v1: torch.Tensor, dim: int = -1, eps: float = 1e-8, flatten: bool = False
) -> torch.Tensor:
    """SLERP from ``v0`` (``t = 0``) to ``v1`` (``t = 1``) of the vectors along ``dim`` (or of the flattened tensors).

    Args:
        t: Interpolation factor.
        v0: The start tensor.
        v1: The end tensor (same shape).
        dim: The axis holding the interpolated vectors (ignored when ``flatten``).
        eps: Below this ``|sin theta|`` the vectors are colinear and interpolated linearly.
        flatten: Interpolate the whole tensors as one vector each.

    Returns:
        A new tensor of ``v0``'s shape, dtype and device.
    """
    dt = acc_dtype(v0)
    a, b = v0.to(dt), v1.to(dt)
    if flatten:
        a, b = a.reshape(-1), b.reshape(-1)
    elif dim != -1:
        a, b = a.transpose(dim, -1), b.transpose(dim, -1)
    cos = (_unit(a) * _unit(b)).sum(dim=-1, keepdim=True)
    theta = torch.acos(cos.clamp(-1, 1))
    sin = torch.sin(theta)
    res = (torch.sin((1 - t) * theta) * a + torch.sin(t * theta) * b) / sin
    res = torch.where(sin.abs() < eps, (1 - t) * a + t * b, res)  # colinear: linear
    if dim != -1 and not flatten:
        res = res.transpose(dim, -1)
    return res.reshape(v0.shape).to(v0.dtype)


def nuslerp_t(weights: list[float]) -> float:
    """The interpolation factor of two weights: ``w_1 / (w_0 + w_1)``, 0.5 when ``|w_0 + w_1| < 1e-6`` (mergekit)."""
    total = sum(weights)
    return 0.5 if abs(total) < 1e-6 else weights[1] / total


class NuSlerpParams(MergeParams):
    """NuSLERP parameters (mergekit's names); the two model weights come from ``--weights``."""

    nuslerp_flatten: bool = True  # interpolate each tensor as one flat vector
    nuslerp_row_wise: bool = False  # not flattened: interpolate along the first axis (default: the last)


class NuSlerpMerger(TwoModelMerger):
    """SLERP of two models (or of their task vectors against an optional base), ``t`` from their weights."""

    name = "nuslerp"
    accepts_base = True
    Params = NuSlerpParams

    def merge_pair(self, t: TensorInputs, v0: torch.Tensor, v1: torch.Tensor) -> torch.Tensor:
        """``nuslerp`` of the two tensors, or ``base + nuslerp`` of their task vectors."""
        p = self.params
        kw = {"dim": 0 if p.nuslerp_row_wise else -1, "flatten": p.nuslerp_flatten}  # type: ignore[attr-defined]
        f = nuslerp_t([float(w) for w in t.weights])
        if t.base is None:
            return nuslerp(f, v0, v1, **kw)
        dt = acc_dtype(v0)
        base = t.base.to(dt)
        return (base + nuslerp(f, v0.to(dt) - base, v1.to(dt) - base, **kw)).to(v0.dtype)
