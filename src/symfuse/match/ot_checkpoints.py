"""``symfuse match --symmetries ot[-soft|-acts|-acts-soft]``: OT alignment of two checkpoints, written like a match.

The output folder holds the aligned source (SOURCE's tensor names), ``transforms.safetensors`` (per-module parts
with the residual part first, plus ``residual``) and ``symfuse_report.json`` whose ``exact`` says whether every
plan was a permutation (the aligned source computes SOURCE's function) or not (soft OT: it does not).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from symfuse.match.publish import AlignRequest, Found, publish_alignment, whole_model_mode


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
    verify: str = "full",
) -> dict:
    """The ``ot`` alignment: SOURCE onto ANCHOR by optimal transport (:func:`symfuse.match.ot.ot_align`), written.

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
        verify: ``none`` skips the check of the written folder (any other mode loads both models whole).

    Returns:
        The report (:func:`symfuse.match.report.alignment_report`; the driver adds ``mode``, ``reg``,
        ``residual_exact``, ``data``, ``max_examples``, ``per_module``).

    Raises:
        CheckpointError: different families / shapes; ValueError: an acts kind without ``data``.
    """
    options = {"ot_kind": kind, "batch_size": batch_size, "max_length": max_length}
    request = AlignRequest(source, anchor, Path(out), tuple(symmetries), data, max_examples, verify=verify,
                           device=device, overwrite=overwrite, options=options)  # fmt: skip
    return publish_alignment(request, "ot", ot_step)


def _check_inputs(src_path: Path, spec: Any, data: str | None) -> None:
    """Refuse, before any model loads, what the acts kinds cannot read: a pixel family without random pixels."""
    from symfuse.io import check_tokenizer
    from symfuse.match.activation import RANDOM_PIXELS

    if spec.inputs != "pixels":
        check_tokenizer(src_path)
    elif data != RANDOM_PIXELS:
        raise ValueError(f"{src_path}: a {spec.family} model reads pixels; pass --data {RANDOM_PIXELS}")


def _ot_batches(src_model: Any, src_path: Path, spec: Any, request: AlignRequest) -> list:
    """The batches feeding both models (acts kinds): ``request.data``'s texts, or random pixels."""
    from symfuse.data import make_batches
    from symfuse.match.activation import pixel_batches

    batch_size, max_length = request.option("batch_size", 16), request.option("max_length", 128)
    if spec.inputs == "pixels":
        return pixel_batches(src_model.config, request.max_examples or 512, batch_size)
    batches = make_batches(request.data, src_path, "train", batch_size, max_length, request.max_examples)
    return [{k: v for k, v in b.items() if k in ("input_ids", "attention_mask")} for b in batches]


def ot_step(request: AlignRequest, tmp: Path) -> Found:
    """The ``ot`` driver's step (:data:`symfuse.match.publish.Step`): transport plans, the aligned source written."""
    from symfuse.checkpoint import CheckpointReader, resolve_checkpoint
    from symfuse.match.activation import _load_model, tied_names
    from symfuse.match.inputs import TRANSFORMS_FILE, check_compatible
    from symfuse.match.ot import kind_settings, ot_align
    from symfuse.match.weights import state_sq_distance
    from symfuse.match.written import stored_dtype, write_model
    from symfuse.symmetry.transforms import save_transforms

    kind = request.option("ot_kind", "ot")
    mode, reg = kind_settings(kind)
    if mode == "acts" and request.data is None:
        raise ValueError(f"{kind} aligns by activations — give a dataset (--data)")
    src_path, anc_path = resolve_checkpoint(request.source), resolve_checkpoint(request.anchor)
    with CheckpointReader(src_path) as src, CheckpointReader(anc_path) as anc:
        check_compatible(src, anc)
        spec = src.spec
    if mode == "acts":
        _check_inputs(src_path, spec, request.data)
    src_model, anc_model = _load_model(src_path), _load_model(anc_path)
    batches = _ot_batches(src_model, src_path, spec, request) if mode == "acts" else None
    result = ot_align(src_model, anc_model, mode, reg, batches, request.kinds, device=request.device)
    matched = copy.deepcopy(src_model)
    matched.load_state_dict(result.state)
    write_model(matched.eval(), src_path, tmp)
    save_transforms(result.module_transforms(), tmp / TRANSFORMS_FILE)
    src_state, anc_state = src_model.state_dict(), anc_model.state_dict()
    tied = tied_names(src_state) | tied_names(anc_state)  # a tied head counted once, as other drivers do
    extra = {
        "mode": f"ot-{mode}", "reg": reg, "residual_exact": result.residual_exact, "data": request.data,
        "max_examples": request.max_examples if mode == "acts" else None, "per_module": result.per_module,
    }  # fmt: skip
    return Found(
        str(src_path), str(anc_path), spec.family, [kind, *request.kinds], exact=result.exact,
        distance_before=state_sq_distance(src_state, anc_state, tied) ** 0.5,
        distance_after=state_sq_distance(result.state, anc_state, tied) ** 0.5, dtype=stored_dtype(src_path),
        device=str(request.device), verify=whole_model_mode(request.verify), extra=extra,
    )  # fmt: skip
