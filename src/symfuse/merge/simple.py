"""Weighted averaging, and Fisher-weighted averaging (Matena & Raffel, 2022)."""

from __future__ import annotations

import logging

import torch
from pydantic import Field

from symfuse.merge.base import MergeParams, Merger, TensorInputs, acc_dtype, chunked, weighted_mean

log = logging.getLogger(__name__)


class SimpleMerger(Merger):
    """``theta = sum_i w_i theta_i``."""

    name = "simple"
    propagates_nonfinite = True

    def merge_tensor(self, t: TensorInputs) -> torch.Tensor:
        """Weighted mean of the K tensors."""
        return weighted_mean(t.tensors, t.weights)


class FisherParams(MergeParams):
    """Fisher merging parameters."""

    epsilon: float = Field(
        default=1e-8, gt=0, le=1, allow_inf_nan=False
    )  # floor on each Fisher entry, so that entries no example touched still average (1e300 overflowed float32)


class FisherMerger(Merger):
    """``theta = sum_i w_i F_i theta_i / sum_i w_i F_i`` with ``F_i`` floored at ``epsilon`` (diagonal Fisher)."""

    name = "fisher"
    required_stats = frozenset({"fisher"})
    propagates_nonfinite = True  # clamp_min keeps NaN; an inf Fisher gives inf / inf
    Params = FisherParams

    def merge_tensor(self, t: TensorInputs) -> torch.Tensor:
        """Fisher-weighted mean; tensors without a Fisher (buffers) are averaged with the model weights."""
        if t.fisher is None:
            self.count("no_fisher_averaged")
            return weighted_mean(t.tensors, t.weights)
        eps = self.params.epsilon  # type: ignore[attr-defined]
        dt = acc_dtype(t.tensors[0])
        shape = t.tensors[0].shape
        num = torch.zeros(shape, dtype=dt, device=self.device).view(-1)  # the output
        den = self.pool.take("fisher.den", num.shape, dt) if self.pool is not None else torch.empty_like(num)
        den.zero_()
        for x, f, w in zip(t.tensors, t.fisher, t.weights, strict=True):  # one model's tensor + Fisher at a time

            def step(n_, d_, x_, f_, w=w):
                fw = f_.to(dt).clamp_min(eps).mul_(w)
                d_ += fw
                n_.addcmul_(fw, x_.to(dt))

            chunked(step, num, den, x.contiguous(), f.contiguous())
        chunked(torch.Tensor.div_, num, den)
        return num.view(shape).to(t.tensors[0].dtype)
