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
    cache: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """Merge one linear layer's weights with RegMean.

    Walks ``weights`` and ``grams`` once, so lazy sequences keep one model's Gram in memory at a time.

    Args:
        weights: K weights, (out, in) (``nn.Linear``) or (in, out) (``conv1d``).
        grams: K input Grams (in, in).
        model_weights: K non-negative weights of the Grams (default 1 each).
        alpha: Off-diagonal scale in [0, 1].
        conv1d: Weights are stored (in, out).
        dtype: Compute precision.
        cache: ``(summed scaled Gram, its Cholesky factor)`` of a previous layer; reused when the summed Gram is
            identical (q / k / v read the same input).

    Returns:
        ``(merged weight in the input layout and dtype, (summed Gram, factor) or None after the lstsq fallback)``.

    Raises:
        ValueError: if shapes disagree (the message names them).
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"regmean alpha must be in [0, 1], got {alpha}")
    mw = list(model_weights) if model_weights is not None else [1.0] * len(weights)
    a = b = None
    out_dtype = None
    for w, g, c in zip(weights, grams, mw, strict=True):  # one model's weight and Gram in memory at a time
        out_dtype = w.dtype
        n_in = g.shape[0]
        wt = w.to(dtype) if conv1d else w.to(dtype).T  # (in, out)
        if wt.shape[0] != n_in or g.shape != (n_in, n_in):
            raise ValueError(f"regmean: weight {tuple(w.shape)} does not match Gram {tuple(g.shape)}")
        gs = g.to(dtype, copy=True)  # never modify the caller's Gram
        del g
        if alpha != 1.0:
            diag = gs.diagonal().clone()
            gs.mul_(alpha)
            gs.diagonal().copy_(diag)  # diag(G') = diag(G): only off-diagonals are scaled
        if c != 1.0:
            gs.mul_(c)
        a = gs.clone() if a is None else a.add_(gs)
        term = gs @ wt  # (in, out)
        del gs
        b = term if b is None else b.add_(term)
    assert a is not None and b is not None and out_dtype is not None
    if cache is not None and cache[0].shape == a.shape and torch.equal(cache[0], a):
        factor = cache[1]
    else:
        factor, info = torch.linalg.cholesky_ex(a)
        if int(info) != 0:
            log.warning("regmean: summed Gram (%d x %d) is not positive definite; solving by lstsq", *a.shape)
            x = torch.linalg.lstsq(a.to(torch.float64), b.to(torch.float64)).solution.to(dtype)
            out = x if conv1d else x.T
            return out.to(out_dtype).contiguous(), None
    x = torch.cholesky_solve(b, factor)  # (in, out)
    out = x if conv1d else x.T
    return out.to(out_dtype).contiguous(), (a, factor)


class RegMeanMerger(Merger):
    """RegMean for every linear weight with Grams; weighted mean for everything else."""

    name = "regmean"
    required_stats = frozenset({"gram"})
    Params = RegMeanParams

    def __init__(self, **params):
        super().__init__(**params)
        self._cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def merge_tensor(self, t: TensorInputs) -> torch.Tensor:
        """RegMean solve for a linear weight with Grams, weighted mean otherwise."""
        if t.gram is None:
            return weighted_mean(t.tensors, t.weights)
        p = self.params
        previous = self._cache
        out, self._cache = regmean_solve(
            t.tensors,
            t.gram,
            t.weights,
            alpha=p.alpha,  # type: ignore[attr-defined]
            conv1d=t.conv1d,
            dtype=getattr(torch, p.dtype),  # type: ignore[attr-defined]
            cache=previous,
        )
        if self._cache is None:
            self.count("lstsq_fallback")
        elif previous is not None and self._cache[1] is previous[1]:
            self.count("factor_reused")
        self.count("regmean_solves")
        return out
