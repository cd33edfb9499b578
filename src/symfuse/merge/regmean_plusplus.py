"""RegMean++ (Nguyen et al., 2025, arXiv 2508.03121): RegMean with Grams collected on the partially merged model.

RegMean merges every linear layer from Grams of the CANDIDATE models' own inputs. RegMean++ merges layer by
layer and collects layer ``l``'s Grams from the inputs that reach layer ``l`` when task ``i``'s data runs through
the MERGED layers ``0 .. l-1`` (and then candidate ``i``'s layer ``l`` up to each of its linear layers): so every
layer is fitted to the features the merged model will actually feed it, and errors of earlier merged layers are
corrected downstream instead of compounding. Layer 0 sees the same inputs as in RegMean, so one layer merges to
exactly the RegMean result.

This module is the merging algebra only: how Grams are collected (hooks on a model, a data loader, a device) is the
caller's, passed as ``collect``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

import torch

from symfuse.merge.base import weighted_mean
from symfuse.merge.regmean import regmean_solve

log = logging.getLogger(__name__)

LayerWeights = Mapping[str, torch.Tensor]
CollectGrams = Callable[[int, Sequence[dict[str, torch.Tensor]]], Sequence[Mapping[str, torch.Tensor]]]


def regmean_plusplus(
    layers: Sequence[Sequence[LayerWeights]],
    collect: CollectGrams,
    model_weights: Sequence[float] | None = None,
    alpha: float = 0.9,
    conv1d: Sequence[str] = (),
    dtype: torch.dtype = torch.float64,
) -> list[dict[str, torch.Tensor]]:
    """Merge K models layer by layer with RegMean++.

    Args:
        layers: Per layer ``l`` (in forward order), the K models' tensors of that layer ``{name: tensor}`` (one
            set of names per layer). Linear weights are ``nn.Linear`` (out, in) unless named in ``conv1d``.
        collect: ``collect(l, merged)`` -> K dicts ``{name: Gram (in, in)}``, one per model, for the linear
            weights of layer ``l``: model ``i``'s data run through the merged layers ``merged`` (``merged[j]`` is
            layer ``j``'s merged tensors, ``j < l``), then through model ``i``'s layer ``l``. Names without a Gram
            are merged by the weighted mean (norms, biases).
        model_weights: K non-negative model weights (default 1 each; normalised for the weighted mean).
        alpha: RegMean off-diagonal scale in [0, 1].
        conv1d: Names of weights stored (in, out) (GPT-2 ``Conv1D``).
        dtype: Solve precision.

    Returns:
        The merged tensors of every layer, ``[{name: tensor}]`` (new tensors, inputs' dtypes).

    Raises:
        ValueError: the K models disagree on a layer's names, ``collect`` returns a wrong number of Gram sets or
            a Gram for an unknown name, or RegMean rejects the inputs (alpha, shapes).
    """
    out: list[dict[str, torch.Tensor]] = []
    for layer, models in enumerate(layers):
        k = len(models)
        names = list(models[0])
        if any(set(m) != set(names) for m in models):
            raise ValueError(f"regmean++: layer {layer}: the {k} models have different tensor names")
        mw = [float(c) for c in model_weights] if model_weights is not None else [1.0] * k
        if len(mw) != k or min(mw) < 0 or sum(mw) <= 0:
            raise ValueError(f"regmean++: {k} models need as many non-negative weights with a positive sum, got {mw}")
        grams = collect(layer, out)  # Grams on the merged prefix: layers 0 .. l-1 already merged
        if len(grams) != k:
            raise ValueError(f"regmean++: collect returned {len(grams)} Gram sets for layer {layer}, expected {k}")
        unknown = {n for g in grams for n in g} - set(names)
        if unknown:
            raise ValueError(f"regmean++: layer {layer}: Grams for unknown tensors {sorted(unknown)}")
        merged: dict[str, torch.Tensor] = {}
        for name in names:
            ws = [m[name] for m in models]
            if all(name in g for g in grams):
                merged[name], _ = regmean_solve(
                    ws, [g[name] for g in grams], mw, alpha, conv1d=name in conv1d, dtype=dtype
                )
            else:
                merged[name] = weighted_mean(ws, [c / sum(mw) for c in mw])
        out.append(merged)
        log.debug("regmean++: layer %d merged (%d tensors)", layer, len(merged))
    return out
