"""RegMean (Jin et al., 2023): per linear layer, the weights minimising the summed regression error on all inputs.

For ``nn.Linear`` ``y = x W^T`` (``W`` (out, in)) with input Grams ``G_i = X_i^T X_i / n_i`` (in, in):

    W^T = (sum_i w_i G_i')^-1  sum_i w_i G_i' W_i^T,     G_i' = alpha G_i + (1 - alpha) diag(G_i)

(``alpha`` scales the off-diagonal entries). GPT-2 ``Conv1D`` stores ``W^T`` (in, out) directly, so the same
formula applies without the transposes. With ``w_i = n_i`` and ``alpha = 1`` this is the least-squares fit on the
concatenated data. Solved by Cholesky (``dtype``, float64 by default), falling back to ``lstsq`` (logged) when the
summed Gram is not positive definite. Tensors that are not linear weights with Grams (embeddings, norms, biases)
get the weighted mean.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Literal

import torch

from symfuse.merge.base import MergeParams, Merger, TensorInputs, weighted_mean

log = logging.getLogger(__name__)


class RegMeanParams(MergeParams):
    """RegMean parameters."""

    alpha: float = 0.9  # off-diagonal scale of each Gram, in [0, 1]
    dtype: Literal["float64", "float32"] = "float64"  # solve precision


def regmean_solve(
    weights: Sequence[torch.Tensor],
    grams: Sequence[torch.Tensor],
    model_weights: Sequence[float] | None = None,
    alpha: float = 0.9,
    conv1d: bool = False,
    dtype: torch.dtype = torch.float64,
    factor: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Merge one linear layer's weights with RegMean.

    Args:
        weights: K weights, (out, in) (``nn.Linear``) or (in, out) (``conv1d``).
        grams: K input Grams (in, in).
        model_weights: K non-negative weights of the Grams (default 1 each).
        alpha: Off-diagonal scale in [0, 1].
        conv1d: Weights are stored (in, out).
        dtype: Compute precision.
        factor: Cholesky factor of the summed scaled Gram, reused from a layer with the same Grams.

    Returns:
        ``(merged weight in the input layout and dtype, Cholesky factor or None after the lstsq fallback)``.

    Raises:
        ValueError: if shapes disagree (the message names them).
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"regmean alpha must be in [0, 1], got {alpha}")
    k = len(weights)
    mw = list(model_weights) if model_weights is not None else [1.0] * k
    n_in = grams[0].shape[0]
    a = None if factor is not None else torch.zeros(n_in, n_in, dtype=dtype)
    b = None
    for w, g, c in zip(weights, grams, mw, strict=True):
        wt = w.to(dtype) if conv1d else w.to(dtype).T  # (in, out)
        if wt.shape[0] != n_in or g.shape != (n_in, n_in):
            raise ValueError(f"regmean: weight {tuple(w.shape)} does not match Gram {tuple(g.shape)}")
        gs = g.to(dtype)
        if alpha != 1.0:
            diag = gs.diagonal().clone()
            gs = gs * alpha
            gs.diagonal().copy_(diag)  # diag(G') = diag(G): only off-diagonals are scaled
        if c != 1.0:
            gs = gs * c
        if a is not None:
            a += gs
        term = gs @ wt  # (in, out)
        b = term if b is None else b.add_(term)
    assert b is not None
    if factor is None:
        assert a is not None
        factor, info = torch.linalg.cholesky_ex(a)
        if int(info) != 0:
            log.warning("regmean: summed Gram (%d x %d) is not positive definite; solving by lstsq", n_in, n_in)
            x = torch.linalg.lstsq(a.to(torch.float64), b.to(torch.float64)).solution.to(dtype)
            out = x if conv1d else x.T
            return out.to(weights[0].dtype).contiguous(), None
    x = torch.cholesky_solve(b, factor)  # (in, out)
    out = x if conv1d else x.T
    return out.to(weights[0].dtype).contiguous(), factor


class RegMeanMerger(Merger):
    """RegMean for every linear weight with Grams; weighted mean for everything else."""

    name = "regmean"
    required_stats = frozenset({"gram"})
    Params = RegMeanParams

    def __init__(self, **params):
        super().__init__(**params)
        self._cache: tuple[Sequence[torch.Tensor], torch.Tensor] | None = None

    def merge_tensor(self, t: TensorInputs) -> torch.Tensor:
        """RegMean solve for a linear weight with Grams, weighted mean otherwise."""
        if t.gram is None:
            return weighted_mean(t.tensors, t.weights)
        p = self.params
        factor = None
        if self._cache is not None and all(
            a.shape == b.shape and torch.equal(a, b) for a, b in zip(self._cache[0], t.gram, strict=True)
        ):
            factor = self._cache[1]  # q / k / v share their input: factor the summed Gram once
            self.count("factor_reused")
        out, factor = regmean_solve(
            t.tensors,
            t.gram,
            t.weights,
            alpha=p.alpha,  # type: ignore[attr-defined]
            conv1d=t.conv1d,
            dtype=getattr(torch, p.dtype),  # type: ignore[attr-defined]
            factor=factor,
        )
        if factor is None:
            self.count("lstsq_fallback")
            self._cache = None
        else:
            self._cache = (t.gram, factor)
        self.count("regmean_solves")
        return out
