"""``symfuse inspect M1 M2 [...]``: every model against the anchor M1, before any merge.

For each pair: family and shape compatibility, the weight distances before and after each symmetry kind
(:mod:`symfuse.inspect.distances`), with data the loss path and the merge-vs-ensemble gap
(:mod:`symfuse.inspect.paths`), and a verdict with its reason (:mod:`symfuse.inspect.verdict`).
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from symfuse.checkpoint import CheckpointReader
from symfuse.data.labels import differ_in_classes
from symfuse.data.vocab import check_same_vocabulary
from symfuse.device import device_name, resolve_device
from symfuse.errors import UsageError
from symfuse.inspect.distances import MODULE_KINDS, has_residual_search, weight_figures
from symfuse.inspect.paths import DEFAULT_LAMBDAS, path_figures
from symfuse.inspect.verdict import FAR, HIGH_BARRIER, INCOMPATIBLE, NO_OP_CUT, SMALL_SHARE, overall, pair_verdict
from symfuse.pairing import describe, shape_problems

log = logging.getLogger(__name__)


def _data_figures(src: CheckpointReader, anc: CheckpointReader, best, data: str, **opts) -> dict:
    """:func:`path_figures` with the best alignment written to a temporary checkpoint folder."""
    from symfuse.match.residual_orthogonal import write_state

    with tempfile.TemporaryDirectory(prefix="symfuse-inspect-") as tmp:
        folder = Path(tmp) / "aligned"
        folder.mkdir()
        write_state(src, best.state, folder, best.untied)
        return path_figures(anc.path, src.path, folder, data, **opts)


def inspect_pair(
    src: CheckpointReader,
    anc: CheckpointReader,
    data: str | None = None,
    kinds: Sequence[str] = MODULE_KINDS,
    residual_iters: int = 2,
    device: str = "cpu",
    **data_opts,
) -> dict:
    """Everything inspect reports about one model against the anchor (see :func:`inspect_models`)."""
    t0 = time.perf_counter()
    out: dict = {"model": str(src.path), "family": src.spec.family, "shapes": describe(src.geometry)}
    problem, heads = shape_problems(src, anc)
    if problem is not None:
        return {**out, "compatible": False, "verdict": INCOMPATIBLE, "reason": f"{problem}: they cannot be merged"}
    if data and heads:  # refused before any work
        raise UsageError(
            f"--data: the heads differ ({heads[0]}: {src.shape(heads[0])} vs {anc.shape(heads[0])}) — the loss along "
            "the path needs one head; inspect these models without --data"
        )
    if data and (named := differ_in_classes(anc.config, src.config)):
        raise UsageError(f"--data: {named} — the loss along the path needs one label set; inspect them without --data")
    figs, best = weight_figures(src, anc, kinds, residual_iters, device, skip=heads, keep_state=data is not None)
    weights = figs.as_dict()
    paths = _data_figures(src, anc, best, data, device=device, **data_opts) if data else None
    verdict, reason = pair_verdict(weights, paths)
    out.update(compatible=True, left_out=heads, **weights, alignment=best.kind, data=paths)
    out.update(verdict=verdict, reason=reason, seconds=time.perf_counter() - t0)
    return out


def inspect_models(
    models: Sequence[str | Path],
    data: str | None = None,
    kinds: Sequence[str] = MODULE_KINDS,
    residual_iters: int = 2,
    device: str = "auto",
    lambdas: Sequence[float] = DEFAULT_LAMBDAS,
    max_examples: int = 64,
    split: str = "test",
) -> dict:
    """Will alignment help, will this merge work? Every model against the first (the anchor).

    Args:
        models: Two or more checkpoint folders; the first is the anchor.
        data: A dataset to measure the loss path and the merge-vs-ensemble gap on (None: weights only).
        kinds: Per-module symmetry kinds to measure.
        residual_iters: Rounds of the whole-model ``residual-orthogonal`` search (pre-norm families; 0: none).
        device: Where the maths runs (``auto``, ``cpu``, ``cuda[:N]``).
        lambdas: Interpolation points with data (0 and 1 included).
        max_examples: Examples of the split read with data.
        split: The split read with data.

    Returns:
        ``{"anchor", "verdict", "reason", "pairs": [...], "thresholds", "device", "seconds"}``; each pair holds its
        ``verdict`` and ``reason``, ``modules`` (relative distances per module: ``before`` and ``after`` each kind
        and ``all``), ``whole_model`` (whole-model relative distances) and ``data`` (the paths, or None).

    Raises:
        UsageError: fewer than two models, or ``lambdas`` without both ends.
        CheckpointError: a folder that is not a readable checkpoint.
    """
    if len(models) < 2:
        raise UsageError("MODELS: inspect compares models with the first — give at least two checkpoint folders")
    if not {0.0, 1.0} <= {float(x) for x in lambdas}:
        raise UsageError("lambdas: the path needs both end models — include 0 and 1")
    if data is not None:  # the paths read the data as the anchor's tokens
        check_same_vocabulary(list(models), "the loss paths read the data as the anchor's tokens")
    t0 = time.perf_counter()
    dev = resolve_device(device)
    opts = {"lambdas": lambdas, "max_examples": max_examples, "split": split}
    with CheckpointReader(models[0]) as anc:
        pairs = []
        for m in models[1:]:
            with CheckpointReader(m) as src:
                iters = residual_iters if has_residual_search(anc) else 0
                pairs.append(inspect_pair(src, anc, data, kinds, iters, str(dev), **opts))
    verdict = overall([p["verdict"] for p in pairs])
    worst = next(p for p in pairs if p["verdict"] == verdict)
    reason = worst["reason"] if len(pairs) == 1 else f"{Path(worst['model']).name}: {worst['reason']}"
    return {
        "anchor": str(anc.path), "family": anc.spec.family, "shapes": describe(anc.geometry), "verdict": verdict,
        "reason": reason, "pairs": pairs, "device": device_name(dev), "data": data,
        "thresholds": {"no_op_cut": NO_OP_CUT, "far": FAR, "small_share": SMALL_SHARE, "high_barrier": HIGH_BARRIER},
        "seconds": time.perf_counter() - t0,
    }  # fmt: skip
