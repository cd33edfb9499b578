"""Model Breadcrumbs (Davari & Belilovsky, 2023): prune both tails of each task vector by magnitude.

Each task vector keeps the ``density`` fraction of its entries that lie just below its largest ``gamma`` fraction
(by magnitude): the largest outliers and the smallest entries are dropped. ``breadcrumbs`` then sums the pruned task
vectors (task arithmetic); ``breadcrumbs-ties`` elects a sign per entry first, as TIES does. As mergekit 0.1.5
(``magnitude_outliers``): ``int(density * n)`` entries are kept, ``int(gamma * n)`` top ones dropped, and fewer top
ones when the two overlap; ``density`` 1 keeps the task vector whole (``gamma`` then does nothing).
"""

from __future__ import annotations

import torch
from pydantic import Field, model_validator

from symfuse.merge.gta import GtaParams, SparseTaskVectorMerger
from symfuse.merge.task_vectors import rescale_l1


def outlier_band(tau: torch.Tensor, density: float, gamma: float) -> torch.Tensor:
    """The boolean mask of the middle band by magnitude: ``int(density n)`` entries below the top ``int(gamma n)``."""
    n = tau.numel()
    if density >= 1:
        return torch.ones(tau.shape, dtype=torch.bool, device=tau.device)
    keep_n, top_n = int(density * n), int(gamma * n)
    bottom = max(0, n - keep_n - top_n)  # too few left: drop fewer of the largest
    order = torch.argsort(tau.abs().reshape(-1), stable=True)  # ascending magnitude
    keep = torch.zeros(n, dtype=torch.bool, device=tau.device)
    keep[order[bottom : bottom + keep_n]] = True
    return keep.view(tau.shape)


def breadcrumbs_prune(tau: torch.Tensor, density: float, gamma: float, rescale: bool = False) -> torch.Tensor:
    """``tau`` with only its :func:`outlier_band` kept (scaled back to its L1 norm with ``rescale``)."""
    if density >= 1:
        return tau.clone()
    kept = outlier_band(tau, density, gamma)
    return rescale_l1(tau, kept) if rescale else torch.where(kept, tau, torch.zeros_like(tau))


class BreadcrumbsParams(GtaParams):
    """Breadcrumbs parameters (mergekit's)."""

    gamma: float = Field(default=0.01, ge=0, lt=1)  # fraction of the largest-magnitude entries dropped

    @model_validator(mode="after")
    def _band_fits(self) -> BreadcrumbsParams:
        if self.density < 1 and self.density + self.gamma > 1:
            raise ValueError(
                f"density + gamma must be <= 1 (kept {self.density} + largest dropped {self.gamma}) — lower one"
            )
        return self


class BreadcrumbsMerger(SparseTaskVectorMerger):
    """Task arithmetic of the band-pruned task vectors."""

    name = "breadcrumbs"
    Params = BreadcrumbsParams

    def sparsify(self, tau: torch.Tensor, name: str, index: int) -> torch.Tensor:
        """The band-pruned task vector."""
        p = self.params
        return breadcrumbs_prune(tau, p.density, p.gamma, p.rescale)  # type: ignore[attr-defined]


class BreadcrumbsTiesMerger(BreadcrumbsMerger):
    """Band-pruned task vectors, signs elected per entry (TIES), the agreeing ones summed."""

    name = "breadcrumbs-ties"
    consensus = True
