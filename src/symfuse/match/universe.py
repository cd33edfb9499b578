"""``residual-orthogonal`` for K models: each onto one anchor, or all onto their common mean (universe matching).

With an anchor, every other model is aligned onto it as
:func:`~symfuse.match.residual_orthogonal.align_residual_orthogonal` does for a pair. Without one (``barycenter``),
the models are aligned onto the mean of the aligned set in the norm-folded basis, and the mean recomputed, until it
stops moving: no model is privileged (Theus et al.'s universe matching). The written models all carry the norms of
one model (the anchor, or the first), so they merge tensor by tensor.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from symfuse.arch.spec import ArchSpec
from symfuse.match.residual_orthogonal import align_residual_orthogonal
from symfuse.match.weights import state_sq_distance
from symfuse.symmetry.residual_orthogonal import check_supported, fold_norms, unfold_into

log = logging.getLogger(__name__)

State = dict[str, torch.Tensor]


@dataclass
class UniverseAlignment:
    """K models aligned together.

    Attributes:
        states: Each model aligned (each computes its own model's function), in the norms of model ``reference``.
        reference: The model whose norms every state carries (the anchor, or 0 for the barycenter).
        untied: Whether an LM head had to be untied.
        history: Per round of the barycenter: ``mean_move`` (relative) and ``spread`` (sum of squared distances to
            the mean, folded basis).
    """

    states: list[State]
    reference: int
    untied: bool
    history: list[dict[str, float]] = field(default_factory=list)


def folded_mean(states: Sequence[Mapping[str, torch.Tensor]]) -> State:
    """The mean of K folded states, tensor by tensor; a tensor whose shapes differ (a task head) is the first's."""
    out: State = {}
    for name, first in states[0].items():
        same = all(name in s and s[name].shape == first.shape for s in states)
        if first.is_floating_point() and same:
            out[name] = sum(s[name].double() for s in states[1:]) + first.double()
            out[name] = (out[name] / len(states)).to(first.dtype)
        else:
            out[name] = first
    return out


def _norm(state: Mapping[str, torch.Tensor]) -> float:
    return sum(float(t.double().square().sum()) for t in state.values() if t.is_floating_point()) ** 0.5


def align_universe(
    states: Sequence[Mapping[str, torch.Tensor]],
    spec: ArchSpec,
    config: Any,
    kinds: Sequence[str],
    anchor: int | None = None,
    rounds: int = 5,
    tol: float = 1e-4,
    iters: int = 10,
    device: str | torch.device = "cpu",
) -> UniverseAlignment:
    """Align K models of one family with one stream map (and per-module maps) each.

    Args:
        states: The models' tensors (stored names), same family and shapes (task heads may differ).
        spec: The family spec (its residual group must be orthogonal).
        config: HF config (every model's).
        kinds: Per-module kinds alternated with each stream map.
        anchor: The index of the model the others are aligned onto; None: onto their common mean.
        rounds: Barycenter rounds at most (each aligns every model onto the current mean).
        tol: The barycenter stops when the mean moves less than this, relative to its norm.
        iters: Rounds of each pairwise alignment at most.
        device: Where the tensors live during the search.

    Returns:
        The :class:`UniverseAlignment`.

    Raises:
        UnsupportedArchitecture: a family whose residual group is not orthogonal.
    """
    check_supported(spec)
    dev = torch.device(device)
    prefix = spec.detect_prefix(states[0])
    folded, untied = [], False
    for s in states:
        f, u = fold_norms({n: t.to(dev) for n, t in s.items()}, spec, config, prefix)
        folded.append(f)
        untied |= u
    ref = 0 if anchor is None else anchor

    def onto(target: State) -> list[State]:
        nonlocal untied
        out = []
        for i, f in enumerate(folded):
            if anchor is not None and i == anchor:
                out.append(f)
                continue
            r = align_residual_orthogonal(f, target, spec, config, kinds, iters, device=dev)
            untied |= r.untied
            out.append(r.aligned)
        return out

    aligned, history = onto(folded[ref]), []
    if anchor is None:
        mean = folded_mean(aligned)
        for it in range(rounds):
            aligned = onto(mean)
            new = folded_mean(aligned)
            move = state_sq_distance(new, mean) ** 0.5 / max(_norm(mean), 1e-30)
            history.append({"mean_move": move, "spread": sum(state_sq_distance(a, new) for a in aligned)})
            log.info("universe round %d: the mean moved %.3g, spread %.6g", it + 1, move, history[-1]["spread"])
            mean = new
            if move < tol:
                break
    target = {n: t.to(dev) for n, t in states[ref].items()}
    final = []
    for a in aligned:
        state, u = unfold_into(a, target, spec, config, prefix)
        untied |= u
        final.append({n: t.cpu() for n, t in state.items()})
    return UniverseAlignment(final, ref, untied, history)


def match_many_residual_orthogonal(
    models: Sequence[str | Path],
    out: Path,
    names: Sequence[str],
    anchor: str | int,
    kinds: Sequence[str],
    rounds: int = 5,
    tol: float = 1e-4,
    device: str | torch.device = "cpu",
) -> dict:
    """``symfuse match-many --symmetries residual-orthogonal,...``: align K checkpoints and write ``out/<name>``.

    Args:
        models: The checkpoints (one family and shape; task heads may differ).
        out: The folder to write into (exists; the caller publishes it).
        names: Each model's sub-folder name.
        anchor: ``closest``, ``barycenter`` or a model index.
        kinds: Per-module kinds beside the stream maps.
        rounds: Barycenter rounds at most.
        tol: Barycenter tolerance (relative move of the mean).
        device: Where the search runs.

    Returns:
        ``{"anchor": the anchor's folder or "barycenter", "rounds": the barycenter's history, "models": [...]}``;
        per model: ``model``, ``out``, ``distance_before`` / ``distance_after`` (to the anchor, or to the mean of the
        inputs / of the aligned set for the barycenter), ``max_abs_logit_diff`` (the written model against its own
        source, checked), ``exact``.

    Raises:
        VerificationError: a written model does not compute its source's function (nothing is published).
    """
    from symfuse.checkpoint import CheckpointReader
    from symfuse.io import check_finite_tensor
    from symfuse.match.inputs import REPORT_FILE, check_compatible
    from symfuse.match.many import squared_distances_to_mean
    from symfuse.match.output_check import verify_outputs
    from symfuse.match.residual_orthogonal import tied_embeddings, write_state
    from symfuse.symmetry.widen import untie

    readers = [CheckpointReader(m) for m in models]
    try:
        for r in readers[1:]:
            check_compatible(readers[0], r)
        if anchor == "closest":
            sq = squared_distances_to_mean(readers)
            anchor = min(range(len(readers)), key=sq.__getitem__)
        states = [{n: check_finite_tensor(r.get(n).clone(), n, r.path) for n in r.names()} for r in readers]
        spec, config = readers[0].spec, readers[0].config
        mixed = len({tied_embeddings(r.config) for r in readers}) > 1
        if mixed:  # tied and untied LM heads (a residual disguise unties): every head its own tensor (KeyError before)
            states = [untie(s, spec, r.config) for s, r in zip(states, readers, strict=True)]
            config = copy.deepcopy(config)
            config.tie_word_embeddings = False
        index = None if anchor == "barycenter" else int(anchor)
        result = align_universe(states, spec, config, kinds, index, rounds, tol, device=device)
        centre_in = folded_mean(states) if index is None else states[index]
        centre_out = folded_mean(result.states) if index is None else result.states[index]
        reports = []
        for r, name, src, new in zip(readers, names, states, result.states, strict=True):
            dtype = next(t.dtype for t in src.values() if t.is_floating_point())
            new = {n: t.to(src[n].dtype if n in src else dtype).contiguous() for n, t in new.items()}
            write_state(r, new, out / name, result.untied or mixed)
            diff = verify_outputs(out / name, r.path, "full", dtype)  # raises when not exact
            report = {"model": str(r.path), "out": name, "distance_before": state_sq_distance(src, centre_in) ** 0.5,
                      "distance_after": state_sq_distance(new, centre_out) ** 0.5, "max_abs_logit_diff": diff,
                      "exact": True, "symmetries": ["residual-orthogonal", *kinds]}  # fmt: skip
            (out / name / REPORT_FILE).write_text(json.dumps(report, indent=2))
            reports.append(report)
        log.info("residual-orthogonal for %d models onto %s: %s", len(models), anchor, result.history)
        return {"anchor": "barycenter" if index is None else str(readers[index].path), "rounds": result.history,
                "models": reports}  # fmt: skip
    finally:
        for r in readers:
            r.close()
