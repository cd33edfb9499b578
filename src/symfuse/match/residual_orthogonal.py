"""``residual-orthogonal`` from weights or activations: one orthogonal map of the stream, alternated with module maps.

The per-module maps are those of the heads and FFN units, found by closed forms.

Both models' norms are folded first (:func:`symfuse.symmetry.residual_orthogonal.fold_norms`). Then, from an initial
``O`` (the identity, or the Procrustes solution on paired hidden states when activations are given):

1. the source rotated by ``O`` is matched module by module onto the anchor with the asked per-module kinds
   (:func:`symfuse.match.weights.match_module_weights`: head permutation, rotation / scaling or head-linear, FFN
   permutation); these maps act on the modules' inner axes, so they commute with ``O``;
2. ``O`` is re-solved with the module maps fixed: the element of the family's group maximising ``tr(O^T M)``, where
   ``M`` sums the cross products of every tensor touching the stream (readers ``W^T A``, writers ``W A^T``, their
   biases, embeddings, heads): the Procrustes problem of ``sum ||T_O(source) - anchor||^2``;
3. repeat until the distance stops falling (``tol``) or ``iters`` rounds.

Each step minimises the same squared distance over one block of variables, so the distance never rises (the
history is returned). Everything runs on ``device``; the assignment solvers on the CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from symfuse.arch.spec import ArchSpec
from symfuse.match.publish import AlignRequest, Found, publish_alignment, whole_model_mode
from symfuse.match.weights import match_module_weights, state_sq_distance
from symfuse.stats.ownership import RESIDUAL_MAP_FILE
from symfuse.symmetry.residual import residual_plan
from symfuse.symmetry.residual_orthogonal import (
    READERS,
    WRITERS,
    check_supported,
    fold_norms,
    procrustes_in_group,
    rotate_residual,
)
from symfuse.symmetry.transforms import ModuleTransform

log = logging.getLogger(__name__)

State = dict[str, torch.Tensor]


@dataclass
class ResidualAlignment:
    """The result of :func:`align_residual_orthogonal`.

    Attributes:
        rot: The stream map ``O`` (d, d), float64, on the CPU.
        modules: The per-module transforms (found on the rotated source), by module key, on the CPU.
        aligned: The folded source with ``O`` and the module maps applied (same function as the source).
        anchor: The folded anchor.
        untied: Whether an LM head had to be untied (source or anchor).
        history: Squared distance to the folded anchor after each round.
    """

    rot: torch.Tensor
    modules: dict[str, ModuleTransform]
    aligned: State
    anchor: State
    untied: bool
    history: list[float] = field(default_factory=list)


def stream_cross(src: Mapping[str, torch.Tensor], anc: Mapping[str, torch.Tensor], spec: ArchSpec, config: Any,
                 prefix: str) -> torch.Tensor:  # fmt: skip
    """``M`` with ``sum ||T_O(src) - anc||^2 = const - 2 tr(O^T M)`` over every tensor touching the stream (float64)."""
    d = spec.geometry(config).d_model
    dev = next(iter(src.values())).device
    m = torch.zeros(d, d, dtype=torch.float64, device=dev)
    for ref in spec.modules(config):
        ws = spec.read_module(src.__getitem__, src.__contains__, ref, config, prefix)
        wa = spec.read_module(anc.__getitem__, anc.__contains__, ref, config, prefix)
        for r in READERS[ref.kind]:
            if r in ws:
                m += ws[r].double().T @ wa[r].double()  # W O ~ A
        for r in WRITERS:
            for rr in (r, r + "_bias"):
                if rr in ws:
                    s, a = ws[rr].double(), wa[rr].double()
                    m += torch.outer(s, a) if s.dim() == 1 else s @ a.T  # O^T W ~ A
    for name, action in residual_plan(spec, list(src), config, prefix).items():
        s, a = src[name].double(), anc[name].double()
        if s.shape != a.shape:
            continue  # a task head of another label set: it follows O but tells nothing of it
        if s.dim() == 1 and name.endswith(".weight") and bool((s == 1).all()):
            continue  # a folded norm's gain
        if action == "first" or (action == "emb" and s.dim() == 4):  # rows written into the stream
            m += s.reshape(s.shape[0], -1) @ a.reshape(a.shape[0], -1).T
        elif action == "both":
            continue  # a d -> d map on top (pooler): quadratic in O, left out of the linear step
        else:  # x O ~ y: embeddings, readers on top, biases
            m += s.reshape(-1, d).T @ a.reshape(-1, d)
    return m


def _apply_modules(state: State, transforms: Mapping[str, ModuleTransform], spec: ArchSpec, config: Any,
                   prefix: str) -> State:  # fmt: skip
    out = dict(state)
    for ref in spec.modules(config):
        t = transforms.get(ref.key)
        if t is not None and t.parts:
            w = spec.read_module(state.__getitem__, state.__contains__, ref, config, prefix)
            out.update(spec.write_module(t.apply(w), ref, config, prefix))
    return out


def _match_modules(src: State, anc: State, spec: ArchSpec, config: Any, prefix: str,
                   kinds: Sequence[str]) -> dict[str, ModuleTransform]:  # fmt: skip
    geo = spec.geometry(config)
    out = {}
    for ref in spec.modules(config):
        ws = spec.read_module(src.__getitem__, src.__contains__, ref, config, prefix)
        wa = spec.read_module(anc.__getitem__, anc.__contains__, ref, config, prefix)
        out[ref.key] = match_module_weights(ref, ws, wa, geo, kinds) if kinds else ModuleTransform(ref.key, ())
    return out


def activation_init(hidden_src: Sequence[torch.Tensor], hidden_anc: Sequence[torch.Tensor], group: str) -> torch.Tensor:
    """``O`` from paired residual-stream activations: Procrustes of ``sum_l H_src,l^T H_anc,l`` (every layer, token)."""
    d = hidden_src[0].shape[-1]
    m = torch.zeros(d, d, dtype=torch.float64)
    for hs, ha in zip(hidden_src, hidden_anc, strict=True):
        m += hs.reshape(-1, d).double().cpu().T @ ha.reshape(-1, d).double().cpu()
    return procrustes_in_group(m, group)


def align_residual_orthogonal(
    source: Mapping[str, torch.Tensor],
    anchor: Mapping[str, torch.Tensor],
    spec: ArchSpec,
    config: Any,
    kinds: Sequence[str] = ("ffn-permutation", "head-permutation", "rotation", "scaling"),
    iters: int = 10,
    tol: float = 1e-6,
    init: torch.Tensor | None = None,
    device: str | torch.device = "cpu",
) -> ResidualAlignment:
    """Align a whole model onto another: ONE stream map ``O`` and per-module maps, alternated (see the module doc).

    Args:
        source: The source model's tensors (stored names).
        anchor: The anchor's (same family and shapes).
        spec: The family spec (its ``residual_group`` must be orthogonal).
        config: HF config (both models').
        kinds: Per-module kinds found at each round (registered kinds with a weight finder; none: ``O`` alone).
        iters: Rounds at most.
        tol: Stop when a round lowers the distance by less than ``tol`` relative.
        init: Initial ``O`` (e.g. :func:`activation_init`); None: the identity.
        device: Where the tensors live during the search.

    Returns:
        The :class:`ResidualAlignment` (``aligned`` computes the source's function).

    Raises:
        UnsupportedArchitecture: a family whose residual group is not orthogonal.
    """
    group = check_supported(spec)
    prefix = spec.detect_prefix(source)
    dev = torch.device(device)
    src, untied_s = fold_norms({n: t.to(dev) for n, t in source.items()}, spec, config, prefix)
    anc, untied_a = fold_norms({n: t.to(dev) for n, t in anchor.items()}, spec, config, prefix)
    d = spec.geometry(config).d_model
    rot = (init if init is not None else torch.eye(d, dtype=torch.float64)).to(dev, torch.float64)
    history: list[float] = []
    modules = _match_modules(rotate_residual(src, spec, config, rot, prefix), anc, spec, config, prefix, kinds)
    for it in range(iters):
        inner = _apply_modules(src, modules, spec, config, prefix)
        rot = procrustes_in_group(stream_cross(inner, anc, spec, config, prefix), group)
        modules = _match_modules(rotate_residual(src, spec, config, rot, prefix), anc, spec, config, prefix, kinds)
        moved = rotate_residual(_apply_modules(src, modules, spec, config, prefix), spec, config, rot, prefix)
        history.append(state_sq_distance(moved, anc))
        log.debug("residual-orthogonal round %d: squared distance %.6g", it + 1, history[-1])
        if len(history) > 1 and history[-2] - history[-1] <= tol * history[-2]:
            break
    aligned = rotate_residual(_apply_modules(src, modules, spec, config, prefix), spec, config, rot, prefix)
    return ResidualAlignment(rot.cpu(), {k: t.to("cpu") for k, t in modules.items()}, aligned, anc,
                             untied_s or untied_a, history)  # fmt: skip


RESIDUAL_ORTHOGONAL_FILE = RESIDUAL_MAP_FILE  # the stream map (``rot``), beside transforms.safetensors


def write_state(reader: Any, state: Mapping[str, torch.Tensor], folder: Path, untied: bool,
                config: Any = None) -> None:  # fmt: skip
    """A whole model's tensors into ``folder`` (one safetensors file), with ``reader``'s config and side files.

    ``untied``: the LM head is its own tensor now (``config.tie_word_embeddings = False``; the same class loads it).
    ``config``: written instead of ``reader``'s (a widened model, :mod:`symfuse.symmetry.widen`).
    """
    from symfuse.checkpoint import copy_side_files
    from symfuse.config_json import update_config_json
    from symfuse.io import save_safetensors

    save_safetensors(dict(state), folder / "model.safetensors", {"format": "pt"})
    copy_side_files(reader, folder)
    if config is not None:
        config.to_json_file(folder / "config.json", use_diff=True)
    if untied:
        update_config_json(folder, {"tie_word_embeddings": False})


def _hidden_states(folder, batches, device) -> list[torch.Tensor]:
    """A checkpoint's residual-stream states on the batches' real tokens, (tokens, d) per layer.

    The embedding output and every block's output but the last (which transformers returns normed).
    """
    from symfuse.checkpoint import load_hf_model

    model = load_hf_model(folder, dtype=torch.float32, validate=False).to(device).eval()
    per_layer: list[list[torch.Tensor]] = []
    with torch.no_grad():
        for b in batches:
            out = model(**{k: v.to(device) for k, v in b.items()}, output_hidden_states=True)
            keep = b["attention_mask"].bool() if "attention_mask" in b else None  # real tokens only
            per_layer.append(
                [(h.cpu()[keep] if keep is not None else h.cpu().flatten(0, -2)) for h in out.hidden_states[:-1]]
            )
    return [torch.cat([p[i] for p in per_layer]) for i in range(len(per_layer[0]))]


def _refine(r: ResidualAlignment, source: Path, spec: ArchSpec, group: str, batches: list, steps: int,
            device: torch.device) -> list[float]:  # fmt: skip
    """Refine ``r``'s stream map in place (``r.aligned``, ``r.rot``) on labelled batches; the losses."""
    from symfuse.checkpoint import load_hf_model
    from symfuse.data.labels import is_causal_lm
    from symfuse.errors import UsageError
    from symfuse.match.refine import refine_stream_map

    if not batches:
        raise UsageError("--refine: the refinement trains on data — give --data DATASET")
    model = load_hf_model(source, dtype=torch.float32, validate=False)
    if r.untied and getattr(model.config, "tie_word_embeddings", False):
        model.config.tie_word_embeddings = False
        model = type(model)(model.config)
    model = model.to(device).double()
    missing = [n for n, _ in model.named_parameters() if n not in r.aligned]
    if missing:
        raise UsageError(f"--refine: {spec.family}'s stored names differ from its modules' ({missing[:2]}); not yet")
    keep = ("input_ids", "attention_mask") if is_causal_lm(model.config) else ("input_ids", "attention_mask", "labels")
    batches = [{k: v.to(device) for k, v in b.items() if k in keep} for b in batches]
    aligned = {n: t.double() for n, t in r.aligned.items()}
    anchor = {n: t.double() for n, t in r.anchor.items()}
    rot, losses = refine_stream_map(aligned, anchor, model, spec, group, batches, steps=steps)
    r.aligned = rotate_residual(r.aligned, spec, model.config, rot.to(device))
    r.rot = r.rot @ rot.cpu()
    return losses


def widen_source(state: State, spec: ArchSpec, config: Any, target_config: Any) -> tuple[State, Any, dict]:
    """:func:`symfuse.symmetry.widen.widen_state` with one log line; ``(state, config, widened_from)``.

    ``widened_from``: the narrow model's widths and norm epsilon (for the report).
    """
    from symfuse.arch.spec import NORM_EPS_KEYS
    from symfuse.symmetry.widen import widen_state

    narrow, wide = spec.geometry(config), spec.geometry(target_config)
    out, wide_config = widen_state(state, spec, config, target_config)
    log.info("widened d %d -> %d, ffn %d -> %d, heads %d -> %d", narrow.d_model, wide.d_model, narrow.d_ffn,
             wide.d_ffn, narrow.n_heads, wide.n_heads)  # fmt: skip
    eps = {k: getattr(config, k) for k in NORM_EPS_KEYS if getattr(config, k, None) is not None}
    widened_from = {"d_model": narrow.d_model, "d_ffn": narrow.d_ffn, "n_heads": narrow.n_heads,
                    "n_kv_heads": narrow.n_kv_heads, "norm_eps": eps,
                    "norm_eps_written": {k: getattr(wide_config, k) for k in eps}}  # fmt: skip
    return out, wide_config, widened_from


def match_residual_orthogonal_checkpoints(
    source: str | Path,
    anchor: str | Path,
    out: str | Path,
    kinds: Sequence[str] = ("ffn-permutation", "head-permutation", "rotation", "scaling"),
    data: str | None = None,
    max_examples: int = 64,
    iters: int = 10,
    device: str | torch.device = "cpu",
    overwrite: bool = False,
    refine: int = 0,
    verify: str = "full",
) -> dict:
    """The ``residual-orthogonal`` alignment (``symfuse match --symmetries residual-orthogonal[,...]``), written.

    The aligned source is written in the anchor's norms (:func:`symfuse.symmetry.residual_orthogonal.unfold_into`),
    so the two share every norm tensor and merge directly; its LM head is untied when the stream map requires it
    (``config.tie_word_embeddings = False``, the same class). The written folder is reloaded and its outputs
    compared with SOURCE's before it is published.

    A SOURCE of the anchor's family that differs only in width (d_model, heads, KV groups, FFN units; same layer
    count and head dimension) is first embedded exactly in the anchor's shapes (:mod:`symfuse.symmetry.widen`): the
    written folder has the anchor's shapes, the norms' epsilon scaled by ``d_n / d_w``, and the report's
    ``widened_from`` records the narrow widths; it is still verified against SOURCE's own outputs.

    Args:
        source: Source checkpoint.
        anchor: Anchor checkpoint (same family and shapes).
        out: Output folder (written atomically): the checkpoint, ``residual_orthogonal.safetensors`` (``rot``),
            ``transforms.safetensors`` (per-module parts) and ``symfuse_report.json``.
        kinds: Per-module kinds alternated with the stream map.
        data: A dataset whose training texts start the search from paired hidden states; None: from the weights.
        max_examples: Examples for the hidden states.
        iters: Rounds at most.
        device: Where the search runs.
        overwrite: Replace an existing ``out``.
        refine: Steps of learned refinement of the stream map on ``data`` (:mod:`symfuse.match.refine`; 0: none).
        verify: ``none`` skips the check of the written folder (any other mode loads both models whole).

    Returns:
        The report (:func:`symfuse.match.report.alignment_report`; the driver adds ``group``, ``init``, ``data``,
        ``history``, ``untied_lm_head``, ``refine``).

    Raises:
        UnsupportedArchitecture: a family whose residual group is not orthogonal.
        UsageError: models of different widths that cannot be widened (:func:`symfuse.symmetry.widen.check_widen`).
        VerificationError: the written model does not compute SOURCE's function (nothing published).
    """
    request = AlignRequest(source, anchor, Path(out), tuple(kinds), data, max_examples, refine, verify=verify,
                           device=device, overwrite=overwrite, options={"iters": iters})  # fmt: skip
    return publish_alignment(request, "residual-orthogonal", residual_orthogonal_step)


def _initial_map(src: Any, anc: Any, request: AlignRequest, group: str, dev: torch.device,
                 widened_from: dict | None, config: Any) -> tuple[torch.Tensor | None, list]:  # fmt: skip
    """``O`` from paired hidden states on ``request.data`` (None without data), and the labelled batches.

    A widened source's stream is the narrow one times ``V`` (:func:`symfuse.symmetry.widen.widening_map`).
    """
    if request.data is None:
        return None, []
    from symfuse.data import load_task_dataset, make_batches
    from symfuse.data.text import is_language_modeling
    from symfuse.evaluate.barrier import head_space
    from symfuse.symmetry.widen import widening_map

    if is_language_modeling(request.data) and not request.refine:  # texts only: the map reads hidden states
        labelled = make_batches(request.data, src.path, "train", 16, 128, request.max_examples)
    else:  # the refinement's loss is the task's along the path: both heads one label space, the data's classes in it
        ds = load_task_dataset(request.data)
        space = head_space(src.config, anc.config, ds, (src.path, anc.path)) if request.refine else None
        labelled = make_batches(ds, src.path, "train", 16, 128, request.max_examples, space=space)
    batches = [{k: v for k, v in b.items() if k in ("input_ids", "attention_mask")} for b in labelled]
    hidden = _hidden_states(src.path, batches, dev)
    if widened_from is not None:
        v = widening_map(widened_from["d_model"], src.spec.geometry(config).d_model, group)
        hidden = [h.double() @ v for h in hidden]
    return activation_init(hidden, _hidden_states(anc.path, batches, dev), group), labelled


def tied_embeddings(config: Any) -> bool:
    """Whether a config ties its LM head to the input embedding (stored once, as the embedding)."""
    return bool(getattr(config, "tie_word_embeddings", False))


def residual_orthogonal_step(request: AlignRequest, tmp: Path) -> Found:
    """The ``residual-orthogonal`` driver's step (:data:`symfuse.match.publish.Step`): the whole model, in memory.

    A narrower source of the anchor's family is first embedded exactly in the anchor's shapes
    (:mod:`symfuse.symmetry.widen`).
    """
    from symfuse.checkpoint import CheckpointReader
    from symfuse.device import resolve_device
    from symfuse.errors import UsageError
    from symfuse.io import check_finite_tensor, save_safetensors
    from symfuse.match.inputs import TRANSFORMS_FILE, check_compatible
    from symfuse.match.verify import is_exact
    from symfuse.symmetry.residual_orthogonal import unfold_into
    from symfuse.symmetry.transforms import save_transforms
    from symfuse.symmetry.widen import untie

    dev, kinds, refine = resolve_device(request.device), list(request.kinds), request.refine
    with CheckpointReader(request.source) as src, CheckpointReader(request.anchor) as anc:
        widening = src.spec.family == anc.spec.family and src.geometry != anc.geometry
        if not widening:
            check_compatible(src, anc)
        elif refine:
            raise UsageError("--refine: not yet for models of different widths — leave it out (the match stays exact)")
        spec, config = src.spec, src.config
        s_state = {n: check_finite_tensor(src.get(n).clone(), n, src.path) for n in src.names()}
        a_state = {n: check_finite_tensor(anc.get(n).clone(), n, anc.path) for n in anc.names()}  # norms too
        widened_from = None
        if widening:  # a narrower source: embedded exactly in the anchor's shapes first (symfuse.symmetry.widen)
            s_state, config, widened_from = widen_source(s_state, spec, config, anc.config)
            a_state = untie(a_state, spec, anc.config)  # both heads their own tensors (config: untied)
            config.tie_word_embeddings = False
        elif tied_embeddings(anc.config) and not tied_embeddings(config):  # e.g. a residual disguise of the anchor
            a_state = untie(a_state, spec, anc.config)  # the anchor's head read as its own tensor: KeyError before
        group = check_supported(spec)
        dtype = next(t.dtype for t in s_state.values() if t.is_floating_point())
        init, labelled = _initial_map(src, anc, request, group, dev, widened_from, config)
        r = align_residual_orthogonal(s_state, a_state, spec, config, kinds, request.option("iters", 10), init=init,
                                      device=dev)  # fmt: skip
        refined = _refine(r, src.path, spec, group, labelled, refine, dev) if refine else None
        final, untied = unfold_into({n: t.cpu() for n, t in r.aligned.items()}, a_state, spec, config)
        final = {n: t.to(s_state[n].dtype if n in s_state else dtype).contiguous() for n, t in final.items()}
        untied = r.untied or untied or widening
        write_state(src, final, tmp, untied, config if widening else None)
        save_safetensors({"rot": r.rot.contiguous()}, tmp / RESIDUAL_ORTHOGONAL_FILE, {"group": group})
        save_transforms(r.modules, tmp / TRANSFORMS_FILE)
        extra = {
            "group": group, "init": "activations" if request.data else "identity", "data": request.data,
            "history": r.history, "untied_lm_head": untied, "widened_from": widened_from,
            "refine": {"steps": refine, "first_loss": refined[0], "last_loss": refined[-1]} if refined else None,
        }  # fmt: skip
        return Found(
            str(src.path), str(anc.path), spec.family, ["residual-orthogonal", *kinds],
            exact=all(is_exact(t) for t in r.modules.values()),
            distance_before=state_sq_distance(s_state, a_state) ** 0.5,
            distance_after=state_sq_distance(final, a_state) ** 0.5,
            dtype=dtype, device=str(dev), verify=whole_model_mode(request.verify), extra=extra,
        )  # fmt: skip
