"""SLERP: spherical linear interpolation between two models, tensor by tensor (mergekit's ``slerp``).

``slerp(t, v0, v1)``: the angle ``theta`` between the flattened tensors (from their unit directions),
``sin((1 - t) theta) / sin(theta) v0 + sin(t theta) / sin(theta) v1`` on the UNNORMALISED tensors; when the
directions are (anti)parallel, ``|cos theta| > 0.9995``, the linear ``(1 - t) v0 + t v1``. A tensor of norm
``<= eps`` (1e-8) is used unnormalised for the angle. ``t = 0`` gives ``v0``, the first ``--models`` entry
(mergekit's ``base_model``), ``t = 1`` the second.

``t`` may be a list (mergekit's gradient ``t: [0, 0.5, 1]``), read per tensor at its place in the layer stack
(:mod:`symfuse.merge.gradient`).

Source: mergekit 0.1.5, ``mergekit/merge_methods/slerp.py``: ``slerp`` (with ``normalize``, ``lerp``,
``DOT_THRESHOLD = 0.9995``, ``eps = 1e-8``) called by ``SlerpTask.execute`` with the base model first. mergekit
computes in float32 numpy on the CPU; here in float32 (float64 for float64 inputs) on the inputs' device.
"""

from __future__ import annotations

import torch

from symfuse.merge.base import acc_dtype
from symfuse.merge.gradient import UnitSetting
from symfuse.merge.pairwise import PairMerger
from symfuse.merge.registry import UnweightedParams

DOT_THRESHOLD = 0.9995  # |cos theta| above this: the tensors are (anti)parallel, interpolate linearly


def lerp(t: float, v0: torch.Tensor, v1: torch.Tensor) -> torch.Tensor:
    """``(1 - t) v0 + t v1`` (a new tensor in the inputs' promoted dtype)."""
    return (1 - t) * v0 + t * v1


def _direction(v: torch.Tensor, eps: float) -> torch.Tensor:
    """``v / |v|`` when ``|v| > eps``, else ``v`` itself (mergekit's ``normalize``)."""
    n = torch.linalg.vector_norm(v)
    return v / n if float(n) > eps else v


def slerp(
    t: float, v0: torch.Tensor, v1: torch.Tensor, dot_threshold: float = DOT_THRESHOLD, eps: float = 1e-8
) -> torch.Tensor:
    """Spherical interpolation from ``v0`` (``t = 0``) to ``v1`` (``t = 1``), mergekit's ``slerp``.

    Args:
        t: Interpolation factor (mergekit's configs use [0, 1]).
        v0: The start tensor.
        v1: The end tensor (same shape).
        dot_threshold: Above this ``|cos theta|`` the result is the linear interpolation.
        eps: Norms at or below this are not divided out.

    Returns:
        A new tensor of ``v0``'s shape, dtype and device.
    """
    dt = acc_dtype(v0)
    a, b = v0.to(dt), v1.to(dt)
    dot = (_direction(a, eps) * _direction(b, eps)).sum()
    if abs(float(dot)) > dot_threshold:
        return lerp(t, a, b).to(v0.dtype)
    theta0 = torch.arccos(dot)
    sin0 = torch.sin(theta0)
    s0 = torch.sin(theta0 * (1 - t)) / sin0  # mergekit: sin(theta_0 - theta_t) / sin(theta_0)
    s1 = torch.sin(theta0 * t) / sin0
    return (s0 * a + s1 * b).to(v0.dtype)


class SlerpParams(UnweightedParams):
    """SLERP parameters (mergekit's names)."""

    t: UnitSetting = 0.5  # 0: the first model, 1: the second; a list: a gradient over the layers


class SlerpMerger(PairMerger):
    """Spherical interpolation of two models, ``t = 0`` the first (mergekit's base model), ``t = 1`` the second."""

    name = "slerp"
    Params = SlerpParams

    def combine(self, t: float, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
        """``slerp(t, first, second)``."""
        return slerp(t, first, second)
