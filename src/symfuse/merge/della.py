"""DELLA (Deep et al., 2024): MagPrune, a random drop whose probability falls with the entry's magnitude rank.

In each row of a task vector (a 1-D tensor is one row; mergekit ranks along dim 1), entry ``j`` of magnitude rank
``r_j`` (0 = smallest, of ``n``) is kept with probability ``density - epsilon + 2 epsilon r_j / (n - 1)``, so the
mean keep rate is ``density``; the kept vector is scaled back to its L1 norm (``rescale``, mergekit's default; the
paper's ``1 / p`` per entry differs). ``della`` then elects signs (TIES) and normalises; ``della-linear`` sums.

Random: each mask comes from :func:`~symfuse.merge.task_vectors.seeded_uniform` (drawn on the CPU, seeded by
``seed``, the tensor's name and the model's index), entry kept where ``u >= 1 - p``: reproducible on any device,
and with ``epsilon`` 0 the very mask DARE draws with ``drop = 1 - density``. mergekit draws ``torch.bernoulli``
from torch's global generator, so the two agree in distribution, not mask for mask.
"""

from __future__ import annotations

import torch
from pydantic import Field, model_validator

from symfuse.merge.gta import GtaParams, SparseTaskVectorMerger
from symfuse.merge.task_vectors import rescale_l1, seeded_uniform
from symfuse.seeds import Seed


def magprune_probs(tau: torch.Tensor, density: float, epsilon: float) -> torch.Tensor:
    """Keep probabilities (float64): ``density -/+ epsilon`` from the smallest to the largest magnitude of a row."""
    rows = tau.reshape(1, -1) if tau.dim() < 2 else tau
    n = rows.shape[1]
    ranks = torch.argsort(torch.argsort(rows.abs(), dim=1, stable=True), dim=1).to(torch.float64)
    norm = ranks / (n - 1) if n > 1 else torch.full_like(ranks, 0.5)
    return (density - epsilon + 2 * epsilon * norm).reshape(tau.shape)


def magprune(tau: torch.Tensor, density: float, epsilon: float, u: torch.Tensor, rescale: bool = True) -> torch.Tensor:
    """``tau`` with entry ``j`` kept where ``u_j >= 1 - p_j`` (:func:`magprune_probs`); L1-rescaled with ``rescale``.

    Args:
        tau: A task vector.
        density: Mean keep probability (1: ``tau`` whole).
        epsilon: Half the spread of the keep probabilities.
        u: Uniform [0, 1) draws of ``tau``'s shape (any device; moved to ``tau``'s).
        rescale: Scale the kept entries back to ``tau``'s L1 norm.
    """
    if density >= 1:
        return tau.clone()
    kept = u.to(device=tau.device, dtype=torch.float64) >= 1 - magprune_probs(tau, density, epsilon)
    return rescale_l1(tau, kept) if rescale else torch.where(kept, tau, torch.zeros_like(tau))


class DellaParams(GtaParams):
    """DELLA parameters (mergekit's, plus the mask seed)."""

    epsilon: float = Field(default=0.15, ge=0, lt=1)  # keep probabilities span density -/+ epsilon
    seed: Seed = 0  # the masks' seed (with the tensor name and the model index)
    rescale: bool = True
    normalize: bool = True

    @model_validator(mode="after")
    def _probs_in_range(self) -> DellaParams:
        if self.density < 1 and not (self.density - self.epsilon > 0 and self.density + self.epsilon < 1):
            raise ValueError(
                f"density +/- epsilon must lie inside (0, 1) (density {self.density}, epsilon {self.epsilon}) — "
                "lower epsilon"
            )
        return self


class DellaMerger(SparseTaskVectorMerger):
    """MagPrune'd task vectors, signs elected per entry (TIES), normalised mean of the agreeing ones."""

    name = "della"
    consensus = True
    Params = DellaParams

    def sparsify(self, tau: torch.Tensor, name: str, index: int) -> torch.Tensor:
        """The MagPrune'd task vector (mask seeded by ``seed``, ``name``, ``index``)."""
        p = self.params
        if p.density >= 1:  # type: ignore[attr-defined]
            return tau.clone()
        u = seeded_uniform(tau.shape, p.seed, name, index)  # type: ignore[attr-defined]
        return magprune(tau, p.density, p.epsilon, u, p.rescale)  # type: ignore[attr-defined]


class DellaLinearParams(DellaParams):
    """DELLA-linear parameters: DELLA's, not normalised by default."""

    normalize: bool = False


class DellaLinearMerger(DellaMerger):
    """Task arithmetic of the MagPrune'd task vectors."""

    name = "della-linear"
    consensus = False
    Params = DellaLinearParams
