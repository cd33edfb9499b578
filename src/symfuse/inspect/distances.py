"""How far one model is from another before and after each symmetry kind: the weight half of ``symfuse inspect``.

Per module (:func:`module_rows`): the Frobenius distance of the source's canonical weights to the anchor's, then
after each applicable per-module kind, added one at a time in stage order (the transforms found by
:func:`symfuse.match.weights.match_module_weights`), the last column being all of them together. Every transform
is an exact symmetry, so each "after" is the distance from the anchor to a model computing the source's function.
For families whose residual stream admits an orthogonal map (pre-norm: gpt2, llama, qwen3, phi3, vit),
:func:`weight_figures` also aligns the whole model with ``residual-orthogonal``
(:func:`symfuse.match.residual_orthogonal.align_residual_orthogonal`, a few rounds) and measures every module and
the whole model after it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from symfuse.arch import ModuleRef
from symfuse.checkpoint import CheckpointReader
from symfuse.match.residual_orthogonal import align_residual_orthogonal
from symfuse.match.weights import match_module_weights
from symfuse.runtime import torch_threads
from symfuse.symmetry.registry import SYMMETRY_KINDS, kinds_for
from symfuse.symmetry.residual_orthogonal import GROUPS, unfold_into
from symfuse.symmetry.transforms import ModuleTransform

log = logging.getLogger(__name__)

# the per-module kinds inspect measures, in the order of the table's columns
MODULE_KINDS = ("ffn-permutation", "head-permutation", "rotation", "scaling")
RESIDUAL_KIND = "residual-orthogonal"
ALL = "all"

State = dict[str, torch.Tensor]


@dataclass
class Alignment:
    """The best exact alignment found for one pair: the aligned source as a whole model.

    Attributes:
        kind: ``all`` (every per-module kind) or ``residual-orthogonal``: the one that brought the source closest.
        state: The aligned source's tensors (stored names; the same function as the source); empty unless asked.
        untied: The LM head had to be untied (``residual-orthogonal`` only).
    """

    kind: str
    state: State
    untied: bool = False


@dataclass
class WeightFigures:
    """The weight distances of one pair (absolute; :meth:`as_dict` divides by the anchor's norm).

    Attributes:
        modules: One row per module: ``key``, ``norm`` (the anchor module's), ``before``, ``after`` (kind -> distance).
        model_norm: The anchor's norm over every floating tensor both models hold.
        model_before: The whole-model distance.
        model_after: The whole-model distance after ``all`` per-module kinds and (pre-norm families)
            ``residual-orthogonal``.
        rounds: Rounds the residual search ran (0: not run).

    Each module row's ``after`` also holds ``residual-orthogonal``: the module's distance in the whole-model
    alignment, when it ran.
    """

    modules: list[dict] = field(default_factory=list)
    model_norm: float = 0.0
    model_before: float = 0.0
    model_after: dict[str, float] = field(default_factory=dict)
    rounds: int = 0

    def as_dict(self) -> dict:
        """The figures relative to the anchor's norm (``|B - A| / |A|``): per module, over all modules, whole model."""
        rows = []
        for r in self.modules:
            scale = r["norm"] or 1.0
            after = {k: v / scale for k, v in r["after"].items()}
            rows.append({"module": r["key"], "before": r["before"] / scale, "after": after})
        norm = sum(r["norm"] ** 2 for r in self.modules) ** 0.5 or 1.0
        total = {"before": sum(r["before"] ** 2 for r in self.modules) ** 0.5 / norm, "after": {}}
        now = [r["before"] for r in self.modules]  # each module's distance with the kinds so far
        for kind in (*MODULE_KINDS, ALL, RESIDUAL_KIND):
            if not any(kind in r["after"] for r in self.modules):
                continue
            cur = [r["after"].get(kind, d) for r, d in zip(self.modules, now, strict=True)]
            now = now if kind == RESIDUAL_KIND else cur  # the whole-model alignment is not added to the others
            total["after"][kind] = sum(d * d for d in cur) ** 0.5 / norm
        scale = self.model_norm or 1.0
        whole = {"before": self.model_before / scale, "after": {k: v / scale for k, v in self.model_after.items()}}
        return {"modules": rows, "total": total, "whole_model": {**whole, "residual_rounds": self.rounds}}


def applicable_kinds(ref: ModuleRef, kinds: Sequence[str] = MODULE_KINDS) -> list[str]:
    """The kinds among ``kinds`` that act on ``ref``'s module, in stage order (the order a match applies them)."""
    return [k.name for k in kinds_for(kinds, ref.kind, "weights")]


def distance(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    """Frobenius distance over the floating tensors both hold (float32 differences: a figure, not a solve)."""
    common = (n for n in a.keys() & b.keys() if a[n].is_floating_point())
    return sum(float(torch.linalg.vector_norm((a[n] - b[n].to(a[n].device)).float())) ** 2 for n in common) ** 0.5


def _norm(state: Mapping[str, torch.Tensor]) -> float:
    """Frobenius norm over the floating tensors."""
    return sum(float(torch.linalg.vector_norm(t.float())) ** 2 for t in state.values() if t.is_floating_point()) ** 0.5


def _on(weights: Mapping[str, torch.Tensor], device: torch.device) -> State:
    return {r: t.to(device) for r, t in weights.items()}


def _parts_of(t: ModuleTransform, kind: str) -> tuple:
    """The parts of ``t`` that ``kind`` introduces (its rotation parts, its permutation ...)."""
    return tuple(p for p in t.parts if p.name in SYMMETRY_KINDS[kind].parts)


def module_row(
    ref: ModuleRef, src: Mapping[str, torch.Tensor], anc: Mapping[str, torch.Tensor], geo, kinds: Sequence[str]
) -> tuple[dict, ModuleTransform]:
    """One module's distances: before, then after each applicable kind, added one at a time in stage order.

    Every kind but ``scaling`` is found in ONE call (the head permutation paired with rotations in mind, as
    ``symfuse match`` pairs heads), and its parts are applied kind by kind; ``scaling`` is then fitted on top in
    closed form. ``symfuse match`` solves rotation and scaling jointly, so its result can only be closer than the
    last column.

    Args:
        ref: The module.
        src: The source's canonical weights.
        anc: The anchor's (same shapes).
        geo: The models' :class:`~symfuse.arch.Geometry`.
        kinds: The per-module kinds to measure (those not acting on this module are skipped).

    Returns:
        ``({"key", "norm", "before", "after": {kind: distance with it and the kinds before it, "all": ...}},
        the transform of all kinds)``.
    """
    here = applicable_kinds(ref, kinds)
    first = [k for k in here if k != "scaling"]
    found = match_module_weights(ref, src, anc, geo, first) if first else ModuleTransform(ref.key, ())
    before = distance(src, anc)
    after: dict[str, float] = {}
    parts: tuple = ()
    for kind in first:
        parts += _parts_of(found, kind)
        after[kind] = distance(ModuleTransform(ref.key, parts).apply(src), anc)
    best = ModuleTransform(ref.key, parts)
    if "scaling" in here:
        scaled = match_module_weights(ref, best.apply(src), anc, geo, ["scaling"])
        best = ModuleTransform(ref.key, parts + scaled.parts)
        after["scaling"] = distance(best.apply(src), anc)
    after[ALL] = after[here[-1]] if here else before
    norm = _norm(anc)
    return {"key": ref.key, "norm": norm, "before": before, "after": after}, best


def module_rows(
    src: CheckpointReader, anc: CheckpointReader, kinds: Sequence[str], device: torch.device, workers: int | None = None
) -> tuple[list[dict], dict[str, ModuleTransform]]:
    """:func:`module_row` for every module of two compatible checkpoints (a module per worker in memory at a time).

    Args:
        src: The source.
        anc: The anchor.
        kinds: The per-module kinds to measure.
        device: Where the maths runs.
        workers: Modules measured at once (None: 2 on a CPU with two cores or more, one torch thread each; 1 on a GPU).

    Returns:
        The rows (absolute distances) and the all-kinds transform of each module (on the CPU).
    """
    if workers is None:
        workers = 1 if device.type != "cpu" else min(2, os.cpu_count() or 1)

    def one(ref: ModuleRef) -> tuple[dict, ModuleTransform]:
        row, t = module_row(ref, _on(src.read_module(ref), device), _on(anc.read_module(ref), device),
                            anc.geometry, kinds)  # fmt: skip
        return row, t.to("cpu")

    refs = anc.modules()
    if workers > 1:
        with torch_threads(1), ThreadPoolExecutor(workers) as pool:
            done = list(pool.map(one, refs))
    else:
        done = [one(ref) for ref in refs]
    return [row for row, _ in done], {ref.key: t for ref, (_, t) in zip(refs, done, strict=True)}


def read_state(reader: CheckpointReader, skip: Sequence[str] = ()) -> State:
    """Every stored tensor of a checkpoint but ``skip`` (in memory: they outlive the reader's files)."""
    return {n: reader.get(n) for n in reader.names() if n not in skip}


def apply_module_transforms(reader: CheckpointReader, state: State, transforms: Mapping[str, ModuleTransform]) -> State:
    """``state`` (the reader's tensors) with each module's transform applied, in stored names and dtypes."""
    out = dict(state)
    spec, config, prefix = reader.spec, reader.config, reader.prefix
    for ref in reader.modules():
        t = transforms.get(ref.key)
        if t is not None and t.parts:
            w = spec.read_module(state.__getitem__, state.__contains__, ref, config, prefix)
            new = spec.write_module(t.apply(w), ref, config, prefix)
            out.update({n: v.to(state[n].dtype).contiguous() for n, v in new.items()})
    return out


def _module_of(reader: CheckpointReader, state: State, ref: ModuleRef) -> State:
    """One module's canonical weights read from a whole-model ``state`` in the reader's stored names."""
    return reader.spec.read_module(state.__getitem__, state.__contains__, ref, reader.config, reader.prefix)


def has_residual_search(reader: CheckpointReader) -> bool:
    """Whether ``residual-orthogonal`` is exact in the checkpoint's family (pre-norm: an orthogonal stream map)."""
    return reader.spec.residual_group in GROUPS


def residual_state(
    src: CheckpointReader, anc: CheckpointReader, s_state: State, a_state: State, kinds: Sequence[str], iters: int,
    device: torch.device,
) -> tuple[State, bool, int]:  # fmt: skip
    """The source aligned by ``residual-orthogonal`` (+ ``kinds``), unfolded into the anchor's norms.

    Returns:
        ``(aligned state in stored names and dtypes, whether the LM head was untied, rounds run)``.
    """
    r = align_residual_orthogonal(s_state, a_state, src.spec, src.config, kinds, iters, device=device)
    final, untied = unfold_into({n: t.cpu() for n, t in r.aligned.items()}, a_state, src.spec, src.config)
    fallback = next(t.dtype for t in s_state.values() if t.is_floating_point())
    final = {n: t.to(s_state[n].dtype if n in s_state else fallback).contiguous() for n, t in final.items()}
    return final, r.untied or untied, len(r.history)


def weight_figures(
    src: CheckpointReader,
    anc: CheckpointReader,
    kinds: Sequence[str] = MODULE_KINDS,
    residual_iters: int = 2,
    device: torch.device | str = "cpu",
    skip: Sequence[str] = (),
    keep_state: bool = False,
) -> tuple[WeightFigures, Alignment]:
    """Every weight distance of one compatible pair, and the alignment that brought the source closest.

    Args:
        src: The source (the model that would be aligned).
        anc: The anchor.
        kinds: Per-module kinds to measure.
        residual_iters: Rounds of the ``residual-orthogonal`` search (pre-norm families; 0: not run).
        device: Where the maths runs.
        skip: Tensors left out of the whole-model figures and the residual search (heads of different shapes).
        keep_state: Return the aligned source's tensors in the :class:`Alignment` (to measure it on data).

    Returns:
        The figures, and the best :class:`Alignment` (by the distance over all modules).
    """
    dev = torch.device(device)
    rows, transforms = module_rows(src, anc, kinds, dev)
    s_state, a_state = read_state(src, skip), read_state(anc, skip)
    figs = WeightFigures(rows, model_norm=_norm(a_state), model_before=distance(s_state, a_state))
    module_sq = sum(r["before"] ** 2 - r["after"][ALL] ** 2 for r in rows)  # the modules' share of the change
    figs.model_after[ALL] = max(0.0, figs.model_before**2 - module_sq) ** 0.5
    best = Alignment(ALL, apply_module_transforms(src, s_state, transforms) if keep_state else {})
    if residual_iters > 0 and has_residual_search(anc):
        state, untied, figs.rounds = residual_state(src, anc, s_state, a_state, kinds, residual_iters, dev)
        figs.model_after[RESIDUAL_KIND] = distance(state, a_state)
        for row, ref in zip(rows, anc.modules(), strict=True):
            row["after"][RESIDUAL_KIND] = distance(*(_module_of(anc, st, ref) for st in (state, a_state)))
        if sum(r["after"][RESIDUAL_KIND] ** 2 for r in rows) < sum(r["after"][ALL] ** 2 for r in rows):
            best = Alignment(RESIDUAL_KIND, state, untied)
    log.debug("%s -> %s: distance %.4g, after %s", src.path, anc.path, figs.model_before, figs.model_after)
    return figs, best
