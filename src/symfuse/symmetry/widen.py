"""Widening: a narrow pre-norm model embedded EXACTLY in the shapes of a wider model of the same family.

Convention as in :mod:`symfuse.symmetry.residual_orthogonal`: the stream is a row vector; the wide model's stream
is ``x' = x V`` with ``V`` (d_n, d_w) semi-orthogonal (``V V^T = I``), so the narrow stream lives in a d_n-dimensional
subspace of the wide one. On the folded model (:func:`~symfuse.symmetry.residual_orthogonal.fold_norms`):

* readers (q k v up gate, heads on top) take ``W V``, writers (o down) ``V^T W`` and ``b V``, embeddings ``E V``:
  ``x' V^T = x`` undoes the embedding wherever the stream is read;
* the norms see ``d_w`` coordinates instead of ``d_n``. RMSNorm: ``ms(x V) = ms(x) d_n / d_w``; LayerNorm too once
  the centring commutes, i.e. when ``V`` maps the normalised all-ones vector to the wide one
  (``1_n V / sqrt(d_n) = 1_w / sqrt(d_w)``) and the complement of ones into its complement (:func:`widening_map`;
  a ``V`` without this changes a LayerNorm model's function). Then ``norm'(x V) = sqrt(d_w / d_n) norm(x) V`` when
  the epsilon is scaled to ``eps d_n / d_w``: the factor is absorbed by scaling every reader (and the heads) by
  ``sqrt(d_n / d_w)`` and the final norm's bias by its inverse, and the widened config carries the scaled epsilon.
  Keeping the wide model's epsilon instead changes the narrow model's normalisation to ``ms + eps_w d_w / d_n``:
  a relative change of about ``(eps_w d_w / d_n - eps_n) / (2 ms)`` per norm, negligible when the stream's mean
  square is far above epsilon, but no longer exact;
* the extra FFN units get zero input rows, biases and output columns; the extra attention heads zero Q, K, V (and
  biases) and zero O columns, so they write nothing. With grouped-query attention whole KV groups are added (the
  query heads per KV head must agree). The head dimension and the layer count must be equal.

Post-LN families (bert, roberta) normalise the stream itself after each skip: their gains cannot be folded into
readers and the norm's ``sqrt(d_w / d_n)`` factor would land on the skip path, so they are refused.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any

import torch

from symfuse.arch.layout import Geometry
from symfuse.arch.spec import GEOMETRY_KEYS, NORM_EPS_KEYS, ArchSpec
from symfuse.errors import UsageError
from symfuse.symmetry.residual import residual_plan
from symfuse.symmetry.residual_orthogonal import (
    GROUPS,
    READERS,
    ResidualOrthogonal,
    _complement,
    _fold_into,
    _norm_names,
    _rotate,
    _scale_heads,
    exact_group,
    fold_norms,
    tied_heads,
)

State = dict[str, torch.Tensor]
WIDTHS = ("d_model", "n_heads", "n_kv_heads", "d_ffn")  # the fields a widening may grow


def describe(geo: Geometry) -> str:
    """``d 256, 6 layers, 4 heads x 64 (4 kv), ffn 1024``: one model's shape in a message."""
    return (
        f"d {geo.d_model}, {geo.n_layers} layers, {geo.n_heads} heads x {geo.head_dim} ({geo.n_kv_heads} kv), "
        f"ffn {geo.d_ffn}"
    )


def widths_differ_only(narrow: Geometry, wide: Geometry) -> bool:
    """Whether two geometries differ, and only in the fields a widening changes (:data:`WIDTHS`)."""
    same = [f for f in ("n_layers", "head_dim", "rope", "gated", "qk_norm", "pos_proj", "stacks")
            if getattr(narrow, f) != getattr(wide, f)]  # fmt: skip
    return narrow != wide and not same


def check_widen(spec: ArchSpec, narrow: Geometry, wide: Geometry, target_type: str | None = None) -> None:
    """Refuse, in one line naming both shapes, a pair that cannot be widened exactly.

    Raises:
        UsageError: another family, a post-LN family, a different layer count / head dimension / GQA group,
            or a target narrower than the source in any width.
    """
    shapes = f"cannot widen {spec.family} ({describe(narrow)}) into ({describe(wide)})"
    if target_type is not None and target_type not in spec.model_types:
        raise UsageError(f"{shapes}: the target is a {target_type} model — widening needs two models of one family")
    if exact_group(spec) not in GROUPS:
        raise UsageError(
            f"{shapes}: {spec.family} is post-LN (each norm reads the stream after the skip), so its gains and the "
            "norm's sqrt(d) factor cannot be folded into the readers — only pre-norm families widen"
        )
    if not widths_differ_only(narrow, wide) and narrow != wide:
        raise UsageError(f"{shapes}: layer count and head dimension must match — only d, heads and FFN may grow")
    if any(getattr(wide, f) < getattr(narrow, f) for f in WIDTHS):
        raise UsageError(f"{shapes}: the target is narrower — give the narrow model first and the wide one second")
    if narrow.group_size != wide.group_size:
        raise UsageError(
            f"{shapes}: query heads per KV head differ ({narrow.group_size} vs {wide.group_size}) — GQA widens by "
            "whole KV groups"
        )


def widening_map(d_n: int, d_w: int, group: str) -> torch.Tensor:
    """A (d_n, d_w) semi-orthogonal ``V`` (float64) exact for the group: LayerNorm's maps ones to ones.

    ``orthogonal``: the first d_n coordinates. ``orthogonal-fixing-ones``:
    ``V = 1_n 1_w^T / sqrt(d_n d_w) + B_n C`` with ``B_n`` an orthonormal basis of the complement of ``1_n`` and
    ``C`` the first ``d_n - 1`` basis vectors of the complement of ``1_w`` (as rows).
    """
    if group == "orthogonal":
        return torch.eye(d_n, d_w, dtype=torch.float64)
    ones = torch.full((d_n, d_w), 1.0 / math.sqrt(d_n * d_w), dtype=torch.float64)
    b_n = _complement(d_n, torch.float64, torch.device("cpu"))
    b_w = _complement(d_w, torch.float64, torch.device("cpu"))
    return ones + b_n @ b_w[:, : d_n - 1].T


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])], dim=0) if rows > t.shape[0] else t


def _pad_cols(t: torch.Tensor, cols: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(t.shape[0], cols - t.shape[1])], dim=1) if cols > t.shape[1] else t


def pad_module(w: Mapping[str, torch.Tensor], kind: str, wide: Geometry) -> State:
    """One module's canonical weights with zero heads / FFN units appended up to ``wide`` (stream axis unchanged).

    New query heads follow the old ones and new KV heads the old KV heads, so with equal group sizes every old
    query head keeps its KV head. Zero Q, K, V and O (and biases) make a head write nothing; zero up / gate rows and
    down columns an FFN unit.
    """
    q_rows, kv_rows = wide.n_heads * wide.head_dim, wide.n_kv_heads * wide.head_dim
    rows = {"q": q_rows, "k": kv_rows, "v": kv_rows, "up": wide.d_ffn, "gate": wide.d_ffn}
    cols = {"o": wide.n_heads * wide.head_dim, "down": wide.d_ffn}
    out = dict(w)
    for role, t in w.items():
        base = role.removesuffix("_bias")
        if base in rows:
            out[role] = _pad_rows(t, rows[base])
        elif base in cols and not role.endswith("_bias"):
            out[role] = _pad_cols(t, cols[base])
    return out


def widened_config(spec: ArchSpec, config: Any, target_config: Any, tie: bool) -> Any:
    """``config`` with the target's widths, the norms' epsilon scaled by ``d_n / d_w`` and ``tie`` for the LM head."""
    d_n, d_w = spec.geometry(config).d_model, spec.geometry(target_config).d_model
    out = copy.deepcopy(config)
    for name in GEOMETRY_KEYS:
        for key in spec.geometry_keys(name):
            if getattr(target_config, key, None) is not None or getattr(config, key, None) is not None:
                setattr(out, key, getattr(target_config, key, None))
    for key in NORM_EPS_KEYS:
        if getattr(config, key, None) is not None:
            setattr(out, key, float(getattr(config, key)) * d_n / d_w)
    out.tie_word_embeddings = tie
    return out


def embed_folded(state: Mapping[str, torch.Tensor], spec: ArchSpec, config: Any, wide_config: Any,
                 embed: torch.Tensor, prefix: str) -> tuple[State, bool]:  # fmt: skip
    """A FOLDED model's tensors in ``wide_config``'s shapes under ``x' = x V`` (``embed``), readers scaled.

    Readers and heads take ``sqrt(d_n / d_w)``, the final norm's bias its inverse (see the module doc); the norms'
    gains become ones of the wide size. ``wide_config.tie_word_embeddings`` must say whether the head is still tied;
    returns ``(state, untied)``: whether the scale untied it.
    """
    wide = spec.geometry(wide_config)
    d_n, d_w = embed.shape
    scale = torch.full((d_w,), math.sqrt(d_n / d_w), dtype=torch.float64)
    part = ResidualOrthogonal(embed)
    out: State = {}
    for ref in spec.modules(config):
        w = spec.read_module(state.__getitem__, state.__contains__, ref, config, prefix)
        w = part.apply(pad_module(w, ref.kind, wide))
        _fold_into(w, READERS[ref.kind], scale, None, f"{spec.family} {ref.key}")
        out.update(spec.write_module(w, ref, wide_config, prefix))
    norms = _norm_names(spec, config, prefix)
    for name, action in residual_plan(spec, list(state), config, prefix).items():
        if name in norms and name.endswith(".weight"):
            out[name] = torch.ones(d_w, dtype=state[name].dtype)
        else:
            out[name] = _rotate(state[name], False, action, embed)
    for name, t in state.items():  # off the stream (buffers, per-head norms outside the modules): unchanged
        out.setdefault(name, t)
    untied = _scale_heads(out, spec, wide_config, prefix, scale)
    final = prefix + spec.final_norm + ".bias" if spec.final_norm else None
    if final in out:
        out[final] = (out[final].to(torch.float64) / scale).to(out[final].dtype)
    return out, untied


def untie(state: Mapping[str, torch.Tensor], spec: ArchSpec, config: Any) -> State:
    """``state`` with every LM head tied to the input embedding stored as its own tensor (a copy of it).

    Load it with ``tie_word_embeddings = False`` (same function): a widened model's head is its own tensor, so its
    anchor's is made one too before the two are aligned.
    """
    prefix = spec.detect_prefix(state)
    out = dict(state)
    for head, emb in tied_heads(spec, state, config, prefix).items():
        out.setdefault(head, state[emb].clone())
    return out


def widen_state(
    state: Mapping[str, torch.Tensor],
    spec: ArchSpec,
    config: Any,
    target_config: Any,
    embed: torch.Tensor | None = None,
) -> tuple[State, Any]:
    """A narrow pre-norm model in the shapes of ``target_config``, computing the narrow model's function exactly.

    Args:
        state: The narrow model's tensors (stored names).
        spec: The family spec (pre-norm: residual group ``orthogonal`` or ``orthogonal-fixing-ones``).
        config: The narrow model's HF config.
        target_config: The wide model's HF config (same family, layer count and head dimension).
        embed: The (d_n, d_w) semi-orthogonal stream map ``V``; None: :func:`widening_map` of the family's group
            (any other must fix the ones direction in LayerNorm families to stay exact).

    Returns:
        ``(state, config)``: the widened tensors (norms folded: gains 1) in the wide shapes, in the narrow tensors'
        dtypes, and the narrow config with the target's widths, epsilon scaled by ``d_n / d_w`` and
        ``tie_word_embeddings`` False when the LM head had to be untied. The same transformers class loads them.

    Raises:
        UsageError: a pair :func:`check_widen` refuses, or an ``embed`` of the wrong shape or not semi-orthogonal.
    """
    narrow, wide = spec.geometry(config), spec.geometry(target_config)
    check_widen(spec, narrow, wide, getattr(target_config, "model_type", None))
    prefix = spec.detect_prefix(state)
    embed = widening_map(narrow.d_model, wide.d_model, exact_group(spec)) if embed is None else embed.double()
    if tuple(embed.shape) != (narrow.d_model, wide.d_model):
        raise UsageError(f"embed: shape {tuple(embed.shape)} — give a ({narrow.d_model}, {wide.d_model}) map")
    if not torch.allclose(embed @ embed.T, torch.eye(narrow.d_model, dtype=torch.float64), atol=1e-8):
        raise UsageError("embed: V V^T is not the identity — give a semi-orthogonal map (orthonormal rows)")
    tied = bool(tied_heads(spec, state, config, prefix))
    folded, untied = fold_norms(state, spec, config, prefix)
    wide_config = widened_config(spec, config, target_config, tied and not untied)
    out, untied_now = embed_folded(folded, spec, config, wide_config, embed, prefix)
    if untied_now:  # a head still tied after folding is untied by the sqrt(d_n / d_w) scale
        wide_config.tie_word_embeddings = False
    return out, wide_config
