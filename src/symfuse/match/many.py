"""Matching several models at once: to the model closest to the plain average, or to a barycenter.

Both work module by module (memory O(one module x number of models)). The closest anchor is chosen on the
module tensors (attention and FFN), whose plain average is what an unaligned merge would produce.
Barycenter = generalised Procrustes, per module: start from the model whose module is closest to the plain average,
align every model to the running mean, re-average, until the mean stops moving (relative change < ``tol``).
With scaling, the scales' common factor (a gauge) is fixed every iteration: per head their geometric mean is 1.
:func:`match_module_many` does it for ONE module (the per-module task of a barycenter pipeline).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from symfuse.arch import Geometry, ModuleRef
from symfuse.checkpoint import CheckpointReader
from symfuse.device import resolve_device
from symfuse.match.inputs import check_compatible, check_finite
from symfuse.match.weights import DEFAULT_SYMMETRIES, check_symmetries, match_module_weights, module_distance
from symfuse.symmetry.transforms import ModuleTransform, QKScaling, VOScaling

log = logging.getLogger(__name__)


def _mean(ws: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {r: torch.stack([w[r].double() for w in ws]).mean(0) for r in ws[0]}


def _norm(w: Mapping[str, torch.Tensor]) -> float:
    return float(sum((t.double() ** 2).sum() for t in w.values())) ** 0.5


def squared_distances_to_mean(readers: Sequence[CheckpointReader]) -> list[float]:
    """Squared Frobenius distance of each model to the plain average, summed module by module.

    Args:
        readers: Open checkpoints of one architecture (memory O(one module x len(readers))).

    Returns:
        One value per reader; the smallest marks the model closest to the plain average (the ``closest`` anchor).
    """
    sq = [0.0] * len(readers)
    for ref in readers[0].modules():
        ws = [r.read_module(ref) for r in readers]
        mean = _mean(ws)
        for i, w in enumerate(ws):
            sq[i] += module_distance(w, mean) ** 2
    return sq


def align_module(
    ref: ModuleRef,
    ws: Sequence[Mapping[str, torch.Tensor]],
    geo: Geometry,
    symmetries: Sequence[str],
    anchor: str | int = "barycenter",
    max_iter: int = 20,
    tol: float = 1e-7,
) -> tuple[list[ModuleTransform], int]:
    """Align one module of K models to an anchor model or to their barycenter.

    Args:
        ref: The module.
        ws: Its canonical weights in each of the K models.
        geo: Geometry of the models.
        symmetries: Subset of :data:`symfuse.match.SYMMETRIES`.
        anchor: Index of the anchor model (it gets the identity), or ``"barycenter"``: generalised Procrustes
            started from the model closest to the plain average of this module.
        max_iter: Barycenter iterations at most.
        tol: Barycenter stops when the mean moves less than ``tol`` relative to its norm.

    Returns:
        ``(one transform per model, iterations)``; ``transform.apply(ws[i])`` is model i's module in the anchor's
        (or the barycenter's) basis.
    """
    if anchor == "barycenter":
        mean = _mean(ws)
        start = min(range(len(ws)), key=lambda i: module_distance(ws[i], mean))
        target: dict[str, torch.Tensor] = {k: v.double() for k, v in ws[start].items()}
    else:
        target = {k: v.double() for k, v in ws[int(anchor)].items()}
    n_iter = 0
    while True:
        ts = [
            ModuleTransform(ref.key, ()) if i == anchor else match_module_weights(ref, w, target, geo, symmetries)
            for i, w in enumerate(ws)
        ]
        n_iter += 1
        if anchor != "barycenter":
            return ts, n_iter
        ts = _centre_scales(ts)
        new = _mean([t.apply({k: v.double() for k, v in w.items()}) for t, w in zip(ts, ws, strict=True)])
        moved = module_distance(new, target) / max(_norm(target), 1e-300)
        target = new
        if moved < tol or n_iter >= max_iter:
            if moved >= tol:
                log.warning("%s: barycenter stopped at max_iter=%d (moved %.3g, tol %.3g)", ref.key, n_iter, moved, tol)
            else:
                log.debug("%s: barycenter converged in %d iterations", ref.key, n_iter)
            return ts, n_iter


def _centre_scales(ts: Sequence[ModuleTransform]) -> list[ModuleTransform]:
    """Fix the barycenter's scale gauge: per block, the geometric mean of every model's QK / VO scale becomes 1.

    A scale common to all models moves the mean along ``(a A, B / a)`` without changing how well the models agree
    (the alignment problem is invariant under it up to that common factor), so without a gauge the mean drifts by
    a little every iteration and never meets the tolerance. Scales are the last parts of a transform and commute
    with each other, so dividing them is applying the inverse common scaling after the transform.
    """
    kinds = (QKScaling, VOScaling)
    common = {}
    for kind in kinds:
        scales = [p.scale for t in ts for p in t.parts if isinstance(p, kind)]
        if len(scales) == len(ts):
            common[kind] = torch.stack(scales).log().mean(0).exp()
    if not common:
        return list(ts)
    return [
        ModuleTransform(t.key, tuple(type(p)(p.scale / common[type(p)]) if type(p) in common else p for p in t.parts))
        for t in ts
    ]


def match_module_many(
    models: Sequence[str | Path],
    module_key: str,
    symmetries: Sequence[str] = DEFAULT_SYMMETRIES,
    anchor: str | int = "barycenter",
    max_iter: int = 20,
    tol: float = 1e-7,
    device: str | torch.device = "cpu",
) -> list[ModuleTransform]:
    """One module of K checkpoints aligned to their barycenter (or to model ``anchor``), reading only that module.

    The per-module task of a barycenter pipeline: every model gets a transform, none is the anchor.

    Args:
        models: K checkpoints of one family and shape.
        module_key: ``ModuleRef.key``, e.g. ``L03.ffn``.
        symmetries: Subset of :data:`symfuse.match.SYMMETRIES`.
        anchor: ``"barycenter"`` or the index of the anchor model.
        max_iter: Barycenter iterations at most.
        tol: Barycenter tolerance (see :func:`align_module`).
        device: Where the module's matching runs (the transforms come back on the CPU).

    Returns:
        One transform per model, in ``models`` order.

    Raises:
        CheckpointError: different families / shapes, missing or non-finite tensors.
        ValueError: fewer than two models.
    """
    if len(models) < 2:
        raise ValueError("match_module_many needs at least two models")
    symmetries = check_symmetries(symmetries)
    dev = resolve_device(device)
    ref = ModuleRef.parse(module_key)
    readers = [CheckpointReader(m) for m in models]
    try:
        for r in readers[1:]:
            check_compatible(readers[0], r)
        ws = [r.read_module(ref) for r in readers]
        for r, w in zip(readers, ws, strict=True):
            check_finite(w, f"{r.path}: {ref.key}")
        ws = [{r: t.to(dev) for r, t in w.items()} for w in ws]
        return [t.to("cpu") for t in align_module(ref, ws, readers[0].geometry, symmetries, anchor, max_iter, tol)[0]]
    finally:
        for r in readers:
            r.close()


def match_many(
    models: Sequence[str | Path],
    anchor: str | int = "closest",
    symmetries: Sequence[str] = DEFAULT_SYMMETRIES,
    max_iter: int = 20,
    tol: float = 1e-7,
    device: str | torch.device = "cpu",
) -> dict[str, Any]:
    """Align several checkpoints of one family to a common anchor.

    Args:
        models: Checkpoints (folders or ids), all of one family and shape.
        anchor: ``"closest"`` (the model closest to the plain average), ``"barycenter"``, or the index of the
            anchor model in ``models``.
        symmetries: Subset of :data:`symfuse.match.SYMMETRIES`.
        max_iter: Barycenter iterations at most (per module).
        tol: Barycenter stops when the mean moves less than ``tol`` relative to its norm.
        device: Where each module's matching runs (one module of the K models on it at a time).

    Returns:
        ``{"anchor": index of the anchor model or "barycenter", "transforms": [ {module key: ModuleTransform}
        per model ], "iterations": {module key: n}}`` (apply with :func:`symfuse.match.assemble_matched`).

    Raises:
        ValueError: unknown anchor mode or fewer than two models.
    """
    if len(models) < 2:
        raise ValueError("match_many needs at least two models")
    if isinstance(anchor, bool) or not (
        anchor in ("closest", "barycenter") or (isinstance(anchor, int) and 0 <= anchor < len(models))
    ):
        raise ValueError(f"anchor must be 'closest', 'barycenter' or a model index < {len(models)}, not {anchor!r}")
    symmetries = check_symmetries(symmetries)
    dev = resolve_device(device)
    readers = [CheckpointReader(m) for m in models]
    try:
        for r in readers[1:]:
            check_compatible(readers[0], r)
        geo = readers[0].geometry
        best: int | None = anchor if isinstance(anchor, int) else None
        if anchor == "closest":
            sq = squared_distances_to_mean(readers)
            best = min(range(len(readers)), key=sq.__getitem__)
            log.info("closest to the plain average: model %d (%s)", best, models[best])
        out: list[dict[str, ModuleTransform]] = [{} for _ in readers]
        iterations: dict[str, int] = {}
        for ref in readers[0].modules():
            ws = [{k: t.to(dev) for k, t in r.read_module(ref).items()} for r in readers]
            ts, iterations[ref.key] = align_module(
                ref, ws, geo, symmetries, "barycenter" if best is None else best, max_iter, tol
            )
            for i, t in enumerate(ts):
                out[i][ref.key] = t.to("cpu")
        return {"anchor": "barycenter" if best is None else best, "transforms": out, "iterations": iterations}
    finally:
        for r in readers:
            r.close()
