"""Task-vector mergers against a base model: task arithmetic, TIES, DARE.

Task vectors ``tau_i = theta_i - theta_base``.

* ``task-arithmetic`` (Ilharco et al., 2023): ``theta = base + lam * sum_i tau_i`` (``lam`` defaults to 1/K, i.e.
  the base plus the mean task vector).
* ``ties`` (Yadav et al., 2023): keep the top ``density`` fraction of each ``tau_i`` by magnitude (trim), elect a
  sign per entry (sign of the summed trimmed vectors), average the trimmed entries that agree with it (disjoint
  mean); ``theta = base + lam * tau`` with ``lam`` default 1.
* ``dare`` (Yu et al., 2024): drop each task-vector entry with probability ``drop`` and rescale the kept ones by
  ``1 / (1 - drop)`` (seeded per tensor and model, so a merge is reproducible whatever the order), then combine
  with ``combine`` = ``task-arithmetic`` or ``ties``.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Literal

import torch
from pydantic import Field, model_validator

from symfuse.merge.base import MergeParams, Merger, TensorInputs
from symfuse.seeds import Seed, torch_seed


def task_vectors(t: TensorInputs) -> list[torch.Tensor]:
    """``theta_i - theta_base`` in float64."""
    assert t.base is not None
    base = t.base.to(torch.float64)
    return [x.to(torch.float64) - base for x in t.tensors]


def trim_top(tau: torch.Tensor, density: float) -> torch.Tensor:
    """Keep the ``density`` fraction of entries with the largest magnitude (ties at the threshold kept)."""
    if density >= 1.0:
        return tau.clone()
    k = max(1, round(density * tau.numel()))
    thresh = tau.abs().flatten().kthvalue(tau.numel() - k + 1).values
    return torch.where(tau.abs() >= thresh, tau, torch.zeros_like(tau))


def ties_combine(taus: Sequence[torch.Tensor], weights: Sequence[float], density: float) -> torch.Tensor:
    """TIES: trim, elect sign, disjoint (weighted) mean of the agreeing entries."""
    trimmed = [trim_top(t, density) for t in taus]
    stacked = torch.stack(trimmed)  # (K, ...)
    w = torch.tensor(list(weights), dtype=torch.float64, device=stacked.device).view(-1, *([1] * trimmed[0].dim()))
    sign = torch.sign((stacked * w).sum(0))
    agree = (torch.sign(stacked) == sign) & (stacked != 0)
    num = (stacked * w * agree).sum(0)
    den = (w * agree).sum(0)
    return torch.where(den > 0, num / den.clamp_min(1e-300), torch.zeros_like(num))


def seeded_uniform(shape: torch.Size | tuple[int, ...], seed: int, name: str, index: int) -> torch.Tensor:
    """Uniform [0, 1) draws of ``shape`` (float32, on the CPU) seeded by ``seed``, tensor ``name`` and model ``index``.

    Drawn on the CPU so that a merge gives the same masks on every device, whatever order tensors come in.
    """
    g = torch.Generator().manual_seed(torch_seed(seed * 1_000_003 + zlib.crc32(name.encode()) * 31 + index))
    return torch.rand(tuple(shape), generator=g)


def dare_drop(tau: torch.Tensor, drop: float, seed: int, name: str, index: int) -> torch.Tensor:
    """Drop entries with probability ``drop`` and rescale the rest by ``1 / (1 - drop)`` (seeded by tensor, model)."""
    if drop <= 0.0:
        return tau.clone()
    if drop >= 1.0:
        raise ValueError(f"dare drop rate must be < 1, got {drop}")
    keep = (seeded_uniform(tau.shape, seed, name, index) >= drop).to(tau.device)
    return torch.where(keep, tau / (1.0 - drop), torch.zeros_like(tau))


def rescale_l1(tau: torch.Tensor, kept: torch.Tensor, eps: float = 1e-7) -> torch.Tensor:
    """``tau * kept`` scaled back to ``tau``'s L1 norm (mergekit's ``rescale``); unscaled when either norm < ``eps``."""
    masked = torch.where(kept, tau, torch.zeros_like(tau))
    before, after = tau.abs().sum(), masked.abs().sum()
    if before < eps or after < eps:
        return masked
    return masked * (before / after)


def gta_combine(
    taus: Sequence[torch.Tensor], weights: Sequence[float], consensus: bool, normalize: bool
) -> torch.Tensor:
    """The generalized task arithmetic (mergekit's) of sparsified task vectors with per-model ``weights``.

    ``consensus``: keep, per entry, only the weighted task vectors whose sign is the majority's (the sign of their
    sum, ``+`` at 0: TIES's "sum" election). ``normalize``: divide by the weights that entered each entry (by the sum
    of the weights without consensus), as mergekit does.
    """
    stacked = torch.stack(list(taus))  # (K, ...)
    w = torch.tensor(list(weights), dtype=stacked.dtype, device=stacked.device).view(-1, *([1] * taus[0].dim()))
    wd = stacked * w
    if consensus:
        majority = torch.where(wd.sum(0) >= 0, 1.0, -1.0).to(wd.dtype)
        agree = torch.sign(wd) == majority
        mixed = torch.where(agree, wd, torch.zeros_like(wd)).sum(0)
        divisor = torch.where(agree, w.expand_as(wd), torch.zeros_like(wd)).sum(0)
        divisor = torch.where(divisor == 0, torch.ones_like(divisor), divisor)
    else:
        mixed = wd.sum(0)
        total = float(sum(weights))
        divisor = torch.tensor(total if abs(total) >= 1e-8 else 1.0, dtype=wd.dtype, device=wd.device)
    return mixed / divisor if normalize else mixed


class TaskArithmeticParams(MergeParams):
    """Task arithmetic parameters."""

    lam: float | None = Field(default=None, allow_inf_nan=False)  # scale of the summed task vectors; None = 1/K


class TaskArithmeticMerger(Merger):
    """``base + lam * sum_i w_i K tau_i`` (with uniform weights: ``base + lam * sum_i tau_i``)."""

    name = "task-arithmetic"
    needs_base = True
    Params = TaskArithmeticParams

    def merge_tensor(self, t: TensorInputs) -> torch.Tensor:
        """Base plus scaled summed task vectors."""
        self.check_inputs(t)
        assert t.base is not None
        k = len(t.weights)
        lam = self.params.lam if self.params.lam is not None else 1.0 / k  # type: ignore[attr-defined]
        base = t.base.to(torch.float64)
        out = base.clone()
        for w, x in zip(t.weights, t.tensors, strict=True):  # one model in memory at a time
            out.add_(x.to(torch.float64) - base, alpha=lam * w * k)
        return out.to(t.base.dtype)


class TiesParams(MergeParams):
    """TIES parameters."""

    density: float = Field(default=0.2, gt=0, le=1)  # fraction of each task vector kept
    lam: float = Field(default=1.0, allow_inf_nan=False)


class TiesMerger(Merger):
    """TIES merging (trim, elect sign, disjoint mean)."""

    name = "ties"
    needs_base = True
    Params = TiesParams

    def merge_tensor(self, t: TensorInputs) -> torch.Tensor:
        """Base plus the TIES-combined task vector."""
        self.check_inputs(t)
        p = self.params
        tau = ties_combine(task_vectors(t), t.weights, p.density)  # type: ignore[attr-defined]
        return (t.base.to(torch.float64) + p.lam * tau).to(t.tensors[0].dtype)  # type: ignore[union-attr,attr-defined]


class DareParams(MergeParams):
    """DARE parameters."""

    drop: float = Field(default=0.9, ge=0, lt=1)  # drop probability of each task-vector entry
    seed: Seed = 0
    combine: Literal["task-arithmetic", "ties"] = "task-arithmetic"
    lam: float | None = Field(default=None, allow_inf_nan=False)  # task-arithmetic: None = 1/K; ties: None = 1
    density: float = Field(default=1.0, gt=0, le=1)  # ties trim after the drop (1 = no further trim)

    @model_validator(mode="after")
    def _density_read_by_ties(self) -> DareParams:
        if "density" in self.model_fields_set and self.combine != "ties":  # it changed nothing
            raise ValueError(f"density is read only with combine ties (a trim after the drop; combine is "
                             f"{self.combine}) — set combine ties, or drop density (drop sets what DARE "
                             "keeps)")  # fmt: skip
        return self


class DareMerger(Merger):
    """DARE drop-and-rescale of each task vector, then task arithmetic or TIES."""

    name = "dare"
    needs_base = True
    Params = DareParams

    def merge_tensor(self, t: TensorInputs) -> torch.Tensor:
        """Base plus the combined dropped-and-rescaled task vectors."""
        self.check_inputs(t)
        p = self.params
        taus = [dare_drop(tau, p.drop, p.seed, t.name, i) for i, tau in enumerate(task_vectors(t))]  # type: ignore[attr-defined]
        k = len(taus)
        if p.combine == "ties":  # type: ignore[attr-defined]
            tau = ties_combine(taus, t.weights, p.density) * (p.lam if p.lam is not None else 1.0)  # type: ignore[attr-defined]
        else:
            lam = p.lam if p.lam is not None else 1.0 / k  # type: ignore[attr-defined]
            tau = lam * sum(w * k * x for w, x in zip(t.weights, taus, strict=True))
        return (t.base.to(torch.float64) + tau).to(t.tensors[0].dtype)  # type: ignore[union-attr]
