"""Residual-stream permutation: ONE permutation of the hidden dimension applied to a whole model.

Convention: ``perm`` (d_model,) int64, new coordinate ``j`` = old coordinate ``perm[j]`` (``x' = x[perm]``).

Why it is exact. Every block reads the residual stream through a LayerNorm / RMSNorm and a Linear, and writes
it through a Linear plus the identity skip. Permuting coordinates commutes with the skip, with LayerNorm and
RMSNorm (mean and variance are permutation-invariant; the weight/bias are permuted with the stream) and with
elementwise maps, so permuting every tensor that touches the stream with the SAME ``perm`` gives a model that
computes the same function (outputs that live in the stream come out permuted; logits / labels are unchanged):

* embeddings (word, position, token type, DeBERTa relative table, ViT patch projection / CLS / positions):
  their d_model axis; with an embedding projection (ELECTRA, embedding size != d_model) only the projection's
  output rows and bias;
* every norm on the stream (per-layer, embedding, final, DeBERTa relative): weight and bias;
* attention ``q k v pos_q pos_k`` and FFN ``up gate``: input columns; attention ``o`` and FFN ``down``: output
  rows and biases;
* heads on top (:class:`symfuse.arch.spec.HeadSpec`): ``in`` readers (classifier, LM head, tied decoder: columns),
  ``in_out`` d->d maps (pooler, MLM transform: rows, columns and bias), ``norm`` (MLM transform LayerNorm).

Families with several stacks (:mod:`symfuse.arch.layout`) permute each residual STREAM as a whole: T5's encoder,
decoder and cross-attention share one stream (the shared embedding and the cross-attention's keys / values read
the encoder output in the decoder's basis), CLIP's two towers have one each, permuted independently (their
projections into the joint space take their tower's permutation on the input columns; the joint space is fixed).

A tied decoder / LM head is the word-embedding matrix itself; both get the same column permutation, so ties
survive. Exactness of DIFFERENT permutations per sublayer: the identity skip forces the basis written by one
sublayer to be the basis read by the next, so in every supported family (pre-LN, post-LN, RMSNorm) only one global
permutation is exact; per-sublayer permutations would need explicit re-basing matrices on the skip path and are
not offered.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from symfuse.arch.spec import ArchSpec, HeadSpec
from symfuse.errors import UnsupportedArchitecture
from symfuse.symmetry.transforms import Transform, Weights, register_transform

_READ_ROLES = ("q", "k", "v", "pos_q", "pos_k", "up", "gate")  # input columns live in the stream
_WRITE_ROLES = ("o", "down")  # output rows (and biases) live in the stream


@register_transform
@dataclass(frozen=True, eq=False)
class ResidualPermutation(Transform):
    """Permutation of the residual stream (see the module docstring): new coordinate j = old ``perm[j]``.

    As a module :class:`Transform` it changes the residual-side axes of ONE module's canonical weights; use
    :func:`permute_residual` to apply it to a whole model consistently (modules, embeddings, norms, heads).
    """

    perm: torch.Tensor  # (d_model,) int64
    name: ClassVar[str] = "resid_perm"

    def apply(self, weights: Mapping[str, torch.Tensor]) -> Weights:
        """Permute input columns of q/k/v/pos_q/pos_k/up/gate and output rows (+ bias) of o/down."""
        out = dict(weights)
        for r in _READ_ROLES:
            if r in weights:
                out[r] = weights[r][:, self.perm]
        for r in _WRITE_ROLES:
            for rr in (r, r + "_bias"):
                if rr in weights:
                    out[rr] = weights[rr][self.perm]
        return out

    def inverse(self) -> ResidualPermutation:
        """The permutation undoing this one."""
        return ResidualPermutation(torch.argsort(self.perm))

    def apply_to_gram(self, role: str, gram: torch.Tensor) -> torch.Tensor:
        """``P G P^T`` for layers reading the stream (q k v pos_q pos_k up gate); other inputs unchanged."""
        if role not in _READ_ROLES:
            return gram
        return gram[..., self.perm, :][..., :, self.perm]

    def tensors(self) -> dict[str, torch.Tensor]:
        """State as named tensors."""
        return {"perm": self.perm}

    def merge(self, earlier: Transform) -> Transform | None:
        """Two residual permutations fuse into one."""
        if isinstance(earlier, ResidualPermutation):
            return ResidualPermutation(earlier.perm[self.perm])
        return None


def residual_plan(
    spec: ArchSpec, names: list[str] | set[str], config: Any, prefix: str, stream: str = ""
) -> dict[str, str]:
    """How each non-module tensor of a checkpoint is touched by a permutation of one residual stream.

    Args:
        spec: The family spec.
        names: All tensor names of the checkpoint / state dict.
        config: HF config.
        prefix: Base-model prefix (:meth:`ArchSpec.detect_prefix`).
        stream: The stream (``StackSpec.stream``; ``""``: the family's only stream). The family's top-level
            embeddings, norms and heads belong to stream ``""``; a stack's own to its stream.

    Returns:
        ``{tensor name: action}``; actions: ``last`` (permute the last axis), ``first`` (the first axis),
        ``both`` (first and second axes of a square matrix), ``cols`` (second axis), ``emb`` (embedding table:
        last axis; patch convolution: first axis). Module tensors (attention /
        FFN) are not listed: :class:`ResidualPermutation` handles them through canonical weights.
    """
    names = set(names)
    plan: dict[str, str] = {}

    def add(path: str, weight_action: str, bias_action: str | None) -> None:
        if path + ".weight" in names:
            plan[path + ".weight"] = weight_action
        if bias_action and path + ".bias" in names:
            plan[path + ".bias"] = bias_action

    stacks = [st for st in spec.all_stacks() if st.stream == stream]
    top = stream == ""
    # ELECTRA with embedding_size != d_model: the embeddings (and their norm) live before a projection that
    # writes the stream; only the projection's output rows and bias are in the stream
    projected = top and bool(spec.embedding_projection) and prefix + f"{spec.embedding_projection}.weight" in names
    if projected:
        add(prefix + spec.embedding_projection, "first", "first")
    embeddings = [*(spec.embeddings if top and not projected else ()), *(e for st in stacks for e in st.embeddings)]
    for emb in (*embeddings, *([spec.relative_embeddings] if top and spec.relative_embeddings else [])):
        path = prefix + emb
        if path in names:  # bare parameter (ViT cls_token / position_embeddings): (..., d)
            plan[path] = "last"
        elif path + ".weight" in names:
            add(path, "emb", "first")
    norms = [None if projected else spec.embedding_norm, spec.final_norm, spec.relative_norm] if top else []
    norms += [n for st in stacks for n in (st.embedding_norm, st.final_norm)]
    geo = spec.geometry(config)
    norms += [
        p for st in stacks for i in range(geo.of(st.name).n_layers) for p in spec.stream_norm_paths(i, "", st.name)
    ]
    for n in norms:
        if n:
            add(prefix + n, "first", "first")
    heads = [*(spec.heads if top else ()), *(h for st in stacks for h in st.heads)]
    for h in (HeadSpec(h.path.replace("{base}", prefix), h.kind) for h in heads):
        if h.kind == "in":
            add(h.path, "cols", None)
        elif h.kind == "in_out":
            add(h.path, "both", "first")
        else:
            add(h.path, "first", "first")
    return plan


def _permute(t: torch.Tensor, action: str, perm: torch.Tensor) -> torch.Tensor:
    if action == "emb":  # embedding table (n, d) or ViT patch convolution (d, c, h, w)
        action = "first" if t.ndim == 4 else "last"
    if action == "last":
        return t[..., perm].contiguous()
    if action == "first":
        return t[perm].contiguous()
    if action == "cols":
        return t[:, perm].contiguous()
    return t[perm][:, perm].contiguous()  # both


def permute_residual(
    state: Mapping[str, torch.Tensor],
    spec: ArchSpec,
    config: Any,
    perm: torch.Tensor | Mapping[str, torch.Tensor],
    prefix: str | None = None,
) -> dict[str, torch.Tensor]:
    """Apply a residual-stream permutation to a whole model's tensors.

    Args:
        state: ``{stored name: tensor}`` of the whole model (a ``state_dict`` or all tensors of a checkpoint).
            Tied tensors may appear under several names; each gets the same permutation.
        spec: The family spec.
        config: HF config.
        perm: (d_model,) new coordinate ``j`` = old ``perm[j]``; for a family with several residual streams
            (:meth:`ArchSpec.streams`, CLIP's two towers) ``{stream: perm}``, one for every stream.
        prefix: Base-model prefix; detected from the names when None.

    Returns:
        A NEW dict with every tensor (untouched ones by reference).

    Raises:
        ValueError: a permutation of the wrong size, or not one per stream.
        UnsupportedArchitecture: if some floating tensor outside the spec has a d_model-sized axis (a head the
            family YAML does not list): add it to the family's ``heads``.
    """
    widths = spec.streams(config)
    perms = dict(perm) if isinstance(perm, Mapping) else {"": perm} if list(widths) == [""] else {}
    if set(perms) != set(widths):
        raise ValueError(f"{spec.family}: give one residual permutation per stream {sorted(widths)}")
    perms = {k: torch.as_tensor(p, dtype=torch.long) for k, p in perms.items()}
    for stream, p in perms.items():
        if sorted(p.tolist()) != list(range(widths[stream])):
            raise ValueError(f"residual permutation must be a permutation of range({widths[stream]})")
    prefix = spec.detect_prefix(state) if prefix is None else prefix
    out = dict(state)
    touched: set[str] = set()
    for ref in spec.modules(config):
        t = ResidualPermutation(perms[spec.stack(ref.stack).stream])
        w = spec.read_module(state.__getitem__, state.__contains__, ref, config, prefix)
        new = spec.write_module(t.apply(w), ref, config, prefix)
        out.update(new)
        touched |= set(new)
    for stream, p in perms.items():
        for name, action in residual_plan(spec, list(state), config, prefix, stream).items():
            out[name] = _permute(state[name], action, p)
            touched.add(name)
    stray = [
        n
        for n, v in state.items()
        if n not in touched and v.is_floating_point() and set(widths.values()) & set(v.shape) and _is_weightish(n)
    ]
    if stray:
        raise UnsupportedArchitecture(
            f"{spec.family}: tensors {stray[:5]} have a d_model-sized axis but no residual-permutation rule; "
            f"add their module to `heads` in arch/families/{spec.family}.yaml"
        )
    return out


def _is_weightish(name: str) -> bool:
    # buffers such as rotary inv_freq / position ids are not parameters of the stream
    return not name.endswith(("inv_freq", "position_ids", "token_type_ids"))
