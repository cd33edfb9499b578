"""Learned refinement of the residual-stream map: ``O`` tuned so that the MERGED model does well, the source exact.

After :func:`symfuse.match.residual_orthogonal.align_residual_orthogonal`, the aligned source ``B'`` computes the
source's function and lies close to the anchor ``A`` in weight space. Weight distance is only a proxy for what a merge
needs: the loss along the path between them. Here the map is refined on data (Theus et al. 2025, "learned
matching"): each step draws ``l ~ U(0.4, 0.6)``, evaluates the task loss of ``(1 - l) A + l T_R(B')`` on a batch, and
moves ``R`` by Adam on its Lie algebra, ``R = exp(K - K^T)`` (on the complement of the ones vector for the
LayerNorm subgroup), so every iterate is an exact element of the family's group: the refined source computes the
source's function exactly, whatever the optimiser does. The per-module maps stay as found.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from symfuse.arch.spec import ArchSpec
from symfuse.symmetry.residual_orthogonal import _complement, rotate_residual

log = logging.getLogger(__name__)

State = dict[str, torch.Tensor]


def group_map(k: torch.Tensor, group: str) -> torch.Tensor:
    """``exp(K - K^T)``: an element of the group (on the complement of 1 for ``orthogonal-fixing-ones``)."""
    r = torch.linalg.matrix_exp(k - k.T)
    if group == "orthogonal":
        return r
    d = k.shape[0] + 1
    b = _complement(d, k.dtype, k.device)
    return torch.full((d, d), 1.0 / d, dtype=k.dtype, device=k.device) + b @ r @ b.T


def lm_or_task_loss(model: torch.nn.Module, params: Mapping[str, torch.Tensor], batch: Mapping[str, Any]):
    """The model's own loss on ``batch`` with ``params``; next-token loss when the batch has no labels."""
    batch = dict(batch)
    if "labels" not in batch:
        labels = batch["input_ids"].clone()
        if "attention_mask" in batch:
            labels[batch["attention_mask"] == 0] = -100
        batch["labels"] = labels
    return torch.func.functional_call(model, dict(params), args=(), kwargs=batch).loss


def refine_stream_map(
    aligned: Mapping[str, torch.Tensor],
    anchor: Mapping[str, torch.Tensor],
    model: torch.nn.Module,
    spec: ArchSpec,
    group: str,
    batches: Sequence[Mapping[str, torch.Tensor]],
    steps: int = 100,
    lr: float = 2e-3,
    seed: int = 0,
    loss: Callable[..., torch.Tensor] = lm_or_task_loss,
) -> tuple[torch.Tensor, list[float]]:
    """Refine the stream map of an aligned (folded) source on data; returns ``(R, losses)``.

    Args:
        aligned: The folded source after alignment (``ResidualAlignment.aligned``).
        anchor: The folded anchor (``ResidualAlignment.anchor``), same names.
        model: A module of the models' class (its parameters are replaced in each call; untied head if needed).
        spec: The family spec.
        group: ``orthogonal`` or ``orthogonal-fixing-ones``.
        batches: Model inputs (with ``labels``, or token ids for next-token loss), cycled through.
        steps: Optimiser steps.
        lr: Adam's learning rate on the generator ``K``.
        seed: Draws of the interpolation weight.
        loss: ``loss(model, params, batch) -> scalar``.

    Returns:
        ``R`` (d, d) float64: apply with ``rotate_residual(aligned, spec, config, R)``; and the loss at each step.
    """
    d = spec.geometry(model.config).d_model
    n = d if group == "orthogonal" else d - 1
    dev = next(iter(aligned.values())).device
    k = torch.zeros(n, n, dtype=torch.float64, device=dev, requires_grad=True)
    opt = torch.optim.Adam([k], lr=lr)
    g = torch.Generator().manual_seed(seed)
    names = [nm for nm, p in model.named_parameters()]
    fixed = {nm: t for nm, t in model.named_buffers()}
    losses: list[float] = []
    model.eval()  # no dropout: the loss of the merged model itself
    for step in range(steps):
        lam = 0.4 + 0.2 * float(torch.rand((), generator=g))
        rotated = rotate_residual(dict(aligned), spec, model.config, group_map(k, group))
        params = {nm: (1 - lam) * anchor[nm] + lam * rotated[nm] for nm in names if nm in anchor}
        value = loss(model, {**fixed, **params}, batches[step % len(batches)])
        opt.zero_grad()
        value.backward()
        opt.step()
        losses.append(float(value.detach()))
        if not math.isfinite(losses[-1]):
            raise FloatingPointError(f"refinement diverged at step {step} (loss {losses[-1]}); lower lr")
    log.info("refined the stream map: loss %.4f -> %.4f over %d steps", losses[0], losses[-1], steps)
    return group_map(k.detach(), group), losses
