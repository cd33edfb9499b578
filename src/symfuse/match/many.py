"""Matching several models at once: to the model closest to the plain average, or to a barycenter.

Both work module by module (memory O(one module x number of models)). The closest anchor is chosen on the
module tensors (attention and FFN), whose plain average is what an unaligned merge would produce.
Barycenter = generalised Procrustes: start from the closest model, align every model to the running mean,
re-average, until the mean stops moving (relative change < ``tol``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from symfuse.checkpoint import CheckpointReader
from symfuse.match.checkpoints import check_compatible
from symfuse.match.weights import DEFAULT_SYMMETRIES, check_symmetries, match_module_weights, module_distance
from symfuse.symmetry.transforms import ModuleTransform

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


def match_many(
    models: Sequence[str | Path],
    anchor: str = "closest",
    symmetries: Sequence[str] = DEFAULT_SYMMETRIES,
    max_iter: int = 20,
    tol: float = 1e-7,
) -> dict[str, Any]:
    """Align several checkpoints of one family to a common anchor.

    Args:
        models: Checkpoints (folders or ids), all of one family and shape.
        anchor: ``"closest"`` (the model closest to the plain average) or ``"barycenter"``.
        symmetries: Subset of :data:`symfuse.match.SYMMETRIES`.
        max_iter: Barycenter iterations at most (per module).
        tol: Barycenter stops when the mean moves less than ``tol`` relative to its norm.

    Returns:
        ``{"anchor": index of the anchor model or "barycenter", "transforms": [ {module key: ModuleTransform}
        per model ], "iterations": {module key: n}}`` (apply with :func:`symfuse.match.assemble_matched`).

    Raises:
        ValueError: unknown anchor mode or fewer than two models.
    """
    if anchor not in ("closest", "barycenter"):
        raise ValueError(f"anchor must be 'closest' or 'barycenter', not {anchor!r}")
    if len(models) < 2:
        raise ValueError("match_many needs at least two models")
    symmetries = check_symmetries(symmetries)
    readers = [CheckpointReader(m) for m in models]
    try:
        for r in readers[1:]:
            check_compatible(readers[0], r)
        refs = readers[0].modules()
        geo = readers[0].geometry
        sq = squared_distances_to_mean(readers)
        best = min(range(len(readers)), key=sq.__getitem__)
        log.info("closest to the plain average: model %d (%s)", best, models[best])
        out: list[dict[str, ModuleTransform]] = [{} for _ in readers]
        iterations: dict[str, int] = {}
        for ref in refs:
            ws = [r.read_module(ref) for r in readers]
            target: dict[str, torch.Tensor] = {k: v.double() for k, v in ws[best].items()}
            n_iter = 0
            while True:
                ts = [
                    ModuleTransform(ref.key, ())
                    if (anchor == "closest" and i == best)
                    else match_module_weights(ref, w, target, geo, symmetries)
                    for i, w in enumerate(ws)
                ]
                n_iter += 1
                if anchor == "closest":
                    break
                new = _mean([t.apply({k: v.double() for k, v in w.items()}) for t, w in zip(ts, ws, strict=True)])
                moved = module_distance(new, target) / max(_norm(target), 1e-300)
                target = new
                if moved < tol or n_iter >= max_iter:
                    break
            iterations[ref.key] = n_iter
            for i, t in enumerate(ts):
                out[i][ref.key] = t
        return {"anchor": best if anchor == "closest" else "barycenter", "transforms": out, "iterations": iterations}
    finally:
        for r in readers:
            r.close()
