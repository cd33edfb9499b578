"""Karcher mean: the Riemannian mean of the models' directions on the unit sphere (mergekit's ``karcher``).

Each flattened tensor splits into its norm and its direction ``u_i``; tensors of norm ``<= tol`` leave the mean
(their weight too). From the normalised weighted mean direction, ``max_iter`` steps of the fixed-point iteration
``T = sum_i a_i theta_i / sin(theta_i) (u_i - cos(theta_i) u)`` (``theta_i`` the angle from ``u`` to ``u_i``,
pairs closer than ``tol`` skipped), ``u <- cos|T| u + sin|T| T / |T|`` (renormalised), stopping when
``|T| < tol``. The result is ``u`` times the weighted mean norm ``sum_i a_i |x_i|`` (zero tensors included).

mergekit always weighs the models equally; here the model weights (``--weights``, uniform by default) are the
``a_i``.

Source: mergekit 0.1.5, ``mergekit/merge_methods/karcher.py``: ``karcher_merge_tensors`` (``max_iter=10``,
``tol=1e-5``) called by ``KarcherTask.execute`` with ``alphas = [1 / K] * K``. mergekit keeps the unit tensors in
the inputs' dtype; here float32 (float64 for float64 inputs).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from pydantic import Field

from symfuse.merge.base import MergeParams, Merger, TensorInputs, acc_dtype, load_all


def karcher_mean(
    tensors: Sequence[torch.Tensor], alphas: Sequence[float], max_iter: int = 10, tol: float = 1e-5
) -> torch.Tensor:
    """The weighted Karcher mean direction of K tensors, scaled by their weighted mean norm.

    Args:
        tensors: K tensors of one shape.
        alphas: K weights (mergekit: ``1 / K`` each).
        max_iter: Most fixed-point iterations.
        tol: Norms, angles and step sizes below this count as zero.

    Returns:
        A new tensor of the first tensor's shape, dtype and device.
    """
    first = tensors[0]
    if len(tensors) == 1:
        return first.clone()
    dt = acc_dtype(first)
    xs = [v.to(dt).reshape(-1) for v in tensors]
    norms = [float(torch.linalg.vector_norm(x)) for x in xs]
    valid = [i for i, n in enumerate(norms) if n > tol]
    if not valid:
        return torch.zeros_like(first)
    total = sum(alphas[i] for i in valid)
    a = [alphas[i] / total for i in valid]
    units = [xs[i] / norms[i] for i in valid]
    u = sum((ai * ui for ai, ui in zip(a, units, strict=True)), torch.zeros_like(units[0]))
    norm_u = float(torch.linalg.vector_norm(u))
    u = units[0].clone() if norm_u < tol else u / norm_u
    for _ in range(max_iter):
        step = torch.zeros_like(u)
        for ai, ui in zip(a, units, strict=True):
            dot = torch.dot(u, ui).clamp(-1.0, 1.0)
            theta = torch.arccos(dot)
            if float(theta) < tol:
                continue
            step += ai * (theta / torch.sin(theta)) * (ui - dot * u)
        norm_step = torch.linalg.vector_norm(step)
        if float(norm_step) < tol:
            break
        u = torch.cos(norm_step) * u + torch.sin(norm_step) * (step / norm_step)
        norm_u = float(torch.linalg.vector_norm(u))
        if norm_u > tol:
            u = u / norm_u
    scale = math.fsum(ai * n for ai, n in zip(alphas, norms, strict=True))
    return (scale * u).reshape(first.shape).to(first.dtype)


class KarcherParams(MergeParams):
    """Karcher mean parameters (mergekit's names)."""

    max_iter: int = Field(default=10, ge=1)  # most fixed-point iterations
    tol: float = Field(default=1e-5, gt=0, allow_inf_nan=False)  # norms, angles and steps below this are zero


class KarcherMerger(Merger):
    """Karcher (Riemannian) mean of K models' directions, times their weighted mean norm."""

    name = "karcher"
    Params = KarcherParams

    def merge_tensor(self, t: TensorInputs) -> torch.Tensor:
        """``karcher_mean`` of the K tensors with the model weights as ``alphas``."""
        p = self.params
        xs = load_all(t.tensors, self.pool, "karcher", None)
        return karcher_mean(xs, [float(w) for w in t.weights], p.max_iter, p.tol)  # type: ignore[attr-defined]
