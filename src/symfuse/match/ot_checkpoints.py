"""``symfuse match --symmetries ot[-soft|-acts|-acts-soft]``: OT alignment of two checkpoints, written like a match.

The output folder holds the aligned source (SOURCE's tensor names), ``transforms.safetensors`` (per-module parts
with the residual part first, plus ``residual``) and ``symfuse_report.json`` whose ``exact`` says whether every
plan was a permutation (the aligned source computes SOURCE's function) or not (soft OT: it does not).
"""

from __future__ import annotations

import copy
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from tempfile import TemporaryDirectory

log = logging.getLogger(__name__)


def match_ot_checkpoints(
    source: str | Path,
    anchor: str | Path,
    out: str | Path,
    kind: str = "ot",
    symmetries: Sequence[str] = (),
    data: str | None = None,
    max_examples: int | None = 512,
    batch_size: int = 16,
    max_length: int = 128,
    device: str = "cpu",
    overwrite: bool = False,
) -> dict:
    """Align SOURCE to ANCHOR by optimal transport (:func:`symfuse.match.ot.ot_align`) and write OUT.

    Args:
        source: Source checkpoint folder (or ``"minilm"`` / hub id).
        anchor: Anchor checkpoint of the same family and shapes.
        out: Output folder (must not exist unless ``overwrite``; written atomically).
        kind: One of :data:`symfuse.match.ot.OT_KINDS` (``*-acts*`` need ``data``).
        symmetries: Extra exact per-head maps after the transport: ``rotation``, ``scaling``.
        data: Dataset feeding both models (acts kinds); ``random-pixels`` for pixel families.
        max_examples: Examples for the statistics.
        batch_size: Examples per forward pass.
        max_length: Truncation length in tokens.
        device: Where the statistics pass runs.
        overwrite: Replace an existing ``out`` (atomically, at the end).

    Returns:
        The report (``exact``, ``distance_before``, ``distance_after``, ``max_abs_logit_diff``, ``per_module``,
        ``seconds``).

    Raises:
        CheckpointError: different families / shapes; ValueError: an acts kind without ``data``.
    """
    from symfuse.checkpoint import CheckpointReader, resolve_checkpoint
    from symfuse.match.activation import (
        RANDOM_PIXELS,
        _load_model,
        _state_distance,
        pixel_batches,
    )
    from symfuse.match.inputs import REPORT_FILE, TRANSFORMS_FILE, check_compatible
    from symfuse.match.ot import kind_settings, ot_align
    from symfuse.match.written import check_written, write_model
    from symfuse.outputs import atomic_output_dir, check_output
    from symfuse.symmetry.transforms import save_transforms

    t0 = time.perf_counter()
    mode, reg = kind_settings(kind)
    if mode == "acts" and data is None:
        raise ValueError(f"{kind} aligns by activations — give a dataset (--data)")
    check_output(out, overwrite)
    src_path, anc_path = resolve_checkpoint(source), resolve_checkpoint(anchor)
    with CheckpointReader(src_path) as src, CheckpointReader(anc_path) as anc:
        check_compatible(src, anc)
        spec = src.spec
    batches = None
    if mode == "acts":
        if spec.inputs == "pixels":
            if data != RANDOM_PIXELS:
                raise ValueError(f"{src_path}: a {spec.family} model reads pixels; pass --data {RANDOM_PIXELS}")
            src_model, anc_model = _load_model(src_path), _load_model(anc_path)
            batches = pixel_batches(src_model.config, max_examples or 512, batch_size)
        else:
            from symfuse.data import make_batches
            from symfuse.io import check_tokenizer

            check_tokenizer(src_path)
            src_model, anc_model = _load_model(src_path), _load_model(anc_path)
            batches = make_batches(data, src_path, "train", batch_size, max_length, max_examples)
            batches = [{k: v for k, v in b.items() if k in ("input_ids", "attention_mask")} for b in batches]
    else:
        src_model, anc_model = _load_model(src_path), _load_model(anc_path)
    result = ot_align(src_model, anc_model, mode, reg, batches, symmetries, device=device)
    anc_state = anc_model.state_dict()
    matched = copy.deepcopy(src_model)
    matched.load_state_dict(result.state)
    report = {
        "source": str(src_path),
        "anchor": str(anc_path),
        "symmetries": [kind, *symmetries],
        "mode": f"ot-{mode}",
        "reg": reg,
        "exact": result.exact,
        "residual_exact": result.residual_exact,
        "data": data,
        "max_examples": max_examples if mode == "acts" else None,
        "distance_before": _state_distance(src_model.state_dict(), anc_state),
        "distance_after": _state_distance(result.state, anc_state),
        "per_module": result.per_module,
    }
    with TemporaryDirectory() as tmp:
        tfile = save_transforms(result.module_transforms(), Path(tmp) / TRANSFORMS_FILE)
        with atomic_output_dir(out, overwrite=overwrite) as dest:
            write_model(matched.eval(), src_path, dest, {TRANSFORMS_FILE: tfile.read_bytes()})
            report |= check_written(dest, src_path, result.exact)  # reloaded: what was written is checked
            report["seconds"] = time.perf_counter() - t0
            (dest / REPORT_FILE).write_text(json.dumps(report, indent=2))
    log.info(
        "OT alignment (%s) %s -> %s: distance %.4g -> %.4g, exact %s",
        kind,
        source,
        anchor,
        report["distance_before"],
        report["distance_after"],
        result.exact,
    )
    return report
