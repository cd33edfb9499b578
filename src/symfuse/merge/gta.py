"""mergekit's generalized task arithmetic: sparsify each task vector, optionally elect signs, sum, normalise, scale.

The shared frame of the sparsifying strategies (``breadcrumbs``, ``breadcrumbs-ties``, ``della``, ``della-linear``):
a subclass says how one task vector is sparsified and whether signs are elected. Parameter names and defaults are
mergekit 0.1.5's (``density`` 1.0 keeps every entry, ``lambda`` 1.0, ``normalize`` / ``rescale`` per method), so a
mergekit YAML's values carry over unchanged; they apply to every model alike (mergekit allows them per model).

Model weights: symfuse normalises them to sum 1; the per-model weight mergekit sees is ``w_i * K``, so equal weights
are mergekit's 1.0 each (as in ``task-arithmetic``), and ``lambda`` scales the sum.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import ConfigDict, Field

from symfuse.merge.base import MergeParams, Merger, TensorInputs
from symfuse.merge.task_vectors import gta_combine, task_vectors


class GtaParams(MergeParams):
    """Parameters every generalized-task-arithmetic strategy shares (mergekit's names)."""

    model_config = ConfigDict(extra="forbid", validate_by_name=True, validate_by_alias=True)

    density: float = Field(default=1.0, gt=0, le=1)  # fraction of each task vector kept (1: all)
    lambda_: float = Field(default=1.0, alias="lambda", allow_inf_nan=False)  # scale of the combined task vector
    normalize: bool = False  # divide by the weights that entered each entry
    rescale: bool = False  # scale each sparsified task vector back to its L1 norm
    int8_mask: bool = False  # mergekit's mask storage switch: accepted, no effect (masks are bool here)


class SparseTaskVectorMerger(Merger):
    """``base + lambda * combine_i(sparsify(theta_i - base))`` (see :func:`~symfuse.merge.task_vectors.gta_combine`)."""

    needs_base = True
    consensus: ClassVar[bool] = False  # elect a sign per entry (TIES's "sum" method)
    Params = GtaParams

    def sparsify(self, tau: torch.Tensor, name: str, index: int) -> torch.Tensor:
        """Model ``index``'s sparsified task vector for tensor ``name`` (a NEW tensor)."""
        raise NotImplementedError

    def merge_tensor(self, t: TensorInputs) -> torch.Tensor:
        """Base plus the combined sparsified task vectors, in model 0's dtype."""
        self.check_inputs(t)
        assert t.base is not None
        p = self.params
        k = len(t.weights)
        taus = [self.sparsify(tau, t.name, i) for i, tau in enumerate(task_vectors(t))]
        tau = gta_combine(taus, [w * k for w in t.weights], self.consensus, p.normalize)  # type: ignore[attr-defined]
        return (t.base.to(torch.float64) + p.lambda_ * tau).to(t.tensors[0].dtype)  # type: ignore[attr-defined]
