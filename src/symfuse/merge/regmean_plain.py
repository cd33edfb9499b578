"""RegMean in plain torch on any device: the device path of the RegMean merger and the oracle of its CPU path.

Same algebra as :mod:`symfuse.merge.regmean` (delta form, one Cholesky factor per layer input, lstsq when the summed
Gram is not positive definite), written as whole-tensor torch ops on the tensors' own device: no buffer pools, no
chunked passes, no in-place BLAS. For ``nn.Linear`` weights ``W_i`` (out, in) and Grams ``G_i`` (in, in)::

    W^T = Wbar^T + S^-1 sum_{i != r} c_i (G_i' - G_r') D_i^T,    S = sum_i c_i G_i',   D_i = W_i - Wbar

with ``G_i' = alpha G_i + (1 - alpha) diag(G_i)``, ``Wbar = sum_i c_i W_i / sum_i c_i`` and ``r`` the model of largest
weight. Memory on the device: the K Grams while the system is built, then ``S``'s factor and K - 1 differences.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from symfuse.errors import NonFiniteError

log = logging.getLogger(__name__)


@dataclass
class PlainSystem:
    """One layer input's factored Gram system on a device.

    Attributes:
        diffs: ``G_i' - G_r'`` per model (None for the reference and for models of weight 0), in ``dtype``.
        weights: The K model weights ``c_i``.
        factor: Lower Cholesky factor of ``S``, or None when ``S`` is not positive definite.
        summed: ``S`` itself when it could not be factored (solved by lstsq), else None.
    """

    diffs: list[torch.Tensor | None]
    weights: list[float]
    factor: torch.Tensor | None
    summed: torch.Tensor | None


def scaled_gram(g: torch.Tensor, alpha: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``alpha G + (1 - alpha) diag(G)`` as a new tensor of ``dtype`` on ``device``."""
    out = g.to(device=device, dtype=dtype, copy=True)
    if alpha != 1.0:
        diag = out.diagonal().clone()
        out.mul_(alpha).diagonal().copy_(diag)
    return out


def plain_system(
    grams: Sequence[torch.Tensor], weights: Sequence[float], alpha: float, dtype: torch.dtype, device: torch.device
) -> PlainSystem:
    """Scale, sum and factor K Grams on ``device`` (each read once; the caller's tensors are not modified).

    Raises:
        NonFiniteError: a Gram holds NaN / inf (the model's index is named).
        ValueError: Grams of different or non-square shapes.
    """
    mw = [float(c) for c in weights]
    ref = max(range(len(mw)), key=mw.__getitem__)
    scaled: list[torch.Tensor] = []
    for i, g in enumerate(grams):
        if g.dim() != 2 or g.shape[0] != g.shape[1] or (scaled and g.shape != scaled[0].shape):
            raise ValueError(f"regmean: Grams must be square and of one size, got {tuple(g.shape)}")
        s = scaled_gram(g, alpha, dtype, device)
        if not bool(torch.isfinite(s).all()):
            raise NonFiniteError(f"regmean: Gram {i} holds NaN / inf values")
        scaled.append(s)
    summed = sum(c * s for c, s in zip(mw, scaled, strict=True))
    diffs: list[torch.Tensor | None] = [
        s.sub_(scaled[ref]) if i != ref and mw[i] != 0.0 else None for i, s in enumerate(scaled)
    ]
    factor, info = torch.linalg.cholesky_ex(summed)
    if int(info) != 0:
        log.warning("regmean: summed Gram (%d x %d) is not positive definite; solving by lstsq", *summed.shape)
        return PlainSystem(diffs, mw, None, summed)
    return PlainSystem(diffs, mw, factor, None)


def plain_apply(system: PlainSystem, weights: Sequence[torch.Tensor], conv1d: bool = False) -> torch.Tensor:
    """RegMean's merged weight from K weights (each read once) and their input's :class:`PlainSystem`.

    Args:
        system: From :func:`plain_system` (same models, same order).
        weights: K weights, (out, in) (``nn.Linear``) or (in, out) (``conv1d``), on the system's device.
        conv1d: Weights are stored (in, out).

    Returns:
        The merged weight in the input layout and stored dtype.
    """
    c = system.weights
    total = sum(c)
    dtype = next(d for d in (system.factor, system.summed) if d is not None).dtype
    wt = [w.to(dtype) if conv1d else w.to(dtype).T for w in weights]  # (in, out), views where no cast is needed
    mean = sum((ci / total) * w for ci, w in zip(c, wt, strict=True))
    rhs = None
    for i, d in enumerate(system.diffs):
        if d is not None:
            term = d @ (wt[i] - mean) * c[i]
            rhs = term if rhs is None else rhs.add_(term)
    if rhs is not None:
        if system.factor is not None:
            mean = mean + torch.cholesky_solve(rhs, system.factor)
        else:
            s = system.summed.double()  # type: ignore[union-attr]
            mean = mean + torch.linalg.lstsq(s.cpu(), rhs.double().cpu()).solution.to(mean.device, dtype)
    out = mean if conv1d else mean.T
    return out.to(weights[0].dtype).contiguous()


def regmean_plain(
    weights: Sequence[torch.Tensor],
    grams: Sequence[torch.Tensor],
    model_weights: Sequence[float] | None = None,
    alpha: float = 0.9,
    conv1d: bool = False,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """RegMean of one linear layer on the weights' device (see the module docstring)."""
    mw = list(model_weights) if model_weights is not None else [1.0] * len(weights)
    system = plain_system(grams, mw, alpha, dtype, weights[0].device)
    return plain_apply(system, weights, conv1d)
