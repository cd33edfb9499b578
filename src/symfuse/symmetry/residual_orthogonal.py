"""Residual-stream orthogonal maps: ONE orthogonal matrix ``O`` acting on the whole model's hidden dimension.

Convention: the stream is a row vector ``x``; the new model's stream is ``x' = x O`` (``O`` (d, d) orthogonal). A
permutation is the special case ``O = P`` with ``x[perm] = x P`` (:mod:`symfuse.symmetry.residual`).

Why it is exact, and for which group. Every block reads the stream through a norm and linear layers and writes it
back through a linear layer and the identity skip. The skip, the linear layers and elementwise maps commute with
any ``O`` once the tensors touching the stream are transformed with it (readers ``W O``, writers ``O^T W`` and their
biases, embeddings ``E O``); the norms are the obstacle:

* a norm's gain ``g`` and bias ``b`` act coordinate-wise and do not commute with ``O``. They are FOLDED first
  (:func:`fold_norms`): ``LN(x) W^T = n(x) diag(g) W^T + b W^T``, so the readers take ``W diag(g)`` and the bias
  ``b W^T``, and the norm keeps gain 1 and bias 0 (same function, same transformers class);
* RMSNorm's normalisation ``x / rms(x)`` commutes with every orthogonal ``O`` (``rms(x O) = rms(x)``): the group is
  the whole ``O(d)`` (``residual_group: orthogonal`` in the family data: llama, phi3, qwen3);
* LayerNorm also subtracts the mean ``(x . 1 / d) 1``; ``(x O) . 1 = x . (O 1)``, so the centring commutes exactly
  when ``O 1 = 1``: the subgroup of orthogonal maps fixing the all-ones vector (``orthogonal-fixing-ones``:
  gpt2, vit). A general ``O`` changes the model (tests show both);
* post-LN families (bert, roberta, ...) normalise the stream itself, so a norm's gain would have to be applied on
  the skip path: only the permutation is exact there (``residual_group: permutation``); those families, Gemma's
  ``1 + w`` gains and Gemma-2's extra norms are refused with one line.

The final norm's gain moves into the heads that read it (``H diag(g)``); its bias cannot move into an LM head
without a bias, so the folded final norm keeps gain 1 and bias ``b / g`` (``n(x) + b / g`` then ``diag(g) H^T``
gives back ``(n(x) g + b) H^T``), rotated with the stream. A tied LM head (GPT-2) is untied when its gain is not 1:
the head and the input embedding are different matrices afterwards (``config.tie_word_embeddings = False``; the
same class loads it). :func:`unfold_into` moves the per-layer norms back to ANOTHER model's gains and biases, so a
matched model and its anchor share their norms exactly and merge directly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from symfuse.arch.spec import ArchSpec
from symfuse.errors import UnsupportedArchitecture
from symfuse.symmetry.residual import residual_plan
from symfuse.symmetry.transforms import Transform, Weights, register_transform

GROUPS = ("orthogonal", "orthogonal-fixing-ones")
READERS = {"attn": ("q", "k", "v"), "ffn": ("up", "gate")}
WRITERS = ("o", "down")
State = dict[str, torch.Tensor]


@register_transform
@dataclass(frozen=True, eq=False)
class ResidualOrthogonal(Transform):
    """An orthogonal map of the residual stream, ``x' = x O``, acting on ONE module's canonical weights.

    Use :func:`rotate_residual` for a whole model (embeddings, norms, heads); the model's norms must be folded.
    """

    rot: torch.Tensor  # (d_model, d_model) orthogonal
    name: ClassVar[str] = "resid_orth"

    def apply(self, weights: Mapping[str, torch.Tensor]) -> Weights:
        """Readers (q k v up gate) take ``W O``; writers (o down) ``O^T W`` and ``O^T b``."""
        out = dict(weights)
        for r in (*READERS["attn"], *READERS["ffn"]):
            if r in weights:
                out[r] = _cast(weights[r].to(self.rot.dtype) @ self.rot, weights[r])
        for r in WRITERS:
            for rr in (r, r + "_bias"):
                if rr in weights:
                    out[rr] = _cast(self.rot.T @ weights[rr].to(self.rot.dtype), weights[rr])
        return out

    def inverse(self) -> ResidualOrthogonal:
        """The transpose."""
        return ResidualOrthogonal(self.rot.T.contiguous())

    def apply_to_gram(self, role: str, gram: torch.Tensor) -> torch.Tensor:
        """``O^T G O`` for inputs read from the stream; other inputs unchanged."""
        if role not in (*READERS["attn"], *READERS["ffn"]):
            return gram
        rot = self.rot.to(gram.dtype)
        return rot.T @ gram @ rot

    def tensors(self) -> dict[str, torch.Tensor]:
        """State as named tensors."""
        return {"rot": self.rot}

    def merge(self, earlier: Transform) -> Transform | None:
        """Two maps of the stream fuse into their product."""
        if isinstance(earlier, ResidualOrthogonal):
            return ResidualOrthogonal(earlier.rot @ self.rot)
        return None


def _cast(new: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return new.to(like.dtype).contiguous()


def exact_group(spec: ArchSpec) -> str:
    """The family's exact group of residual maps after folding (``ArchSpec.residual_group``)."""
    return spec.residual_group


def check_supported(spec: ArchSpec) -> str:
    """The family's orthogonal group, or :class:`UnsupportedArchitecture` naming the one it has."""
    group = exact_group(spec)
    if group not in GROUPS:
        raise UnsupportedArchitecture(
            f"{spec.family}: an orthogonal map of the residual stream is not exact in this family (its norms cannot "
            f"be folded into the layers that read them; its exact residual group is the {group}) — use "
            "residual-permutation"
        )
    return group


def _complement(d: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An orthonormal basis (d, d - 1) of the vectors orthogonal to the all-ones vector (a Householder reflection)."""
    u = torch.full((d,), -1.0 / math.sqrt(d), dtype=dtype, device=device)
    u[0] += 1.0
    u = u / u.norm()
    h = torch.eye(d, dtype=dtype, device=device) - 2.0 * torch.outer(u, u)  # maps e_0 to 1 / sqrt(d)
    return h[:, 1:]


def procrustes_in_group(m: torch.Tensor, group: str) -> torch.Tensor:
    """The element ``O`` of the group maximising ``tr(O^T M)`` (float64).

    ``orthogonal``: ``U V^T`` for ``M = U S V^T``. ``orthogonal-fixing-ones``: ``O = 1 1^T / d + B R B^T`` with ``B``
    an orthonormal basis of the complement of 1 and ``R`` the Procrustes solution of ``B^T M B`` (the fixed
    direction contributes ``1^T M 1 / d`` whatever ``R`` is).
    """
    m = m.to(torch.float64)
    if group == "orthogonal":
        u, _, vh = torch.linalg.svd(m)
        return u @ vh
    d = m.shape[0]
    b = _complement(d, m.dtype, m.device)
    u, _, vh = torch.linalg.svd(b.T @ m @ b)
    ones = torch.full((d, d), 1.0 / d, dtype=m.dtype, device=m.device)
    return ones + b @ (u @ vh) @ b.T


def random_in_group(d: int, group: str, generator: torch.Generator) -> torch.Tensor:
    """A random element of the group (Haar on O(d), or on the complement of 1), float64, on the CPU."""
    q, r = torch.linalg.qr(torch.randn(d, d, generator=generator, dtype=torch.float64))
    q = q * torch.sign(torch.diagonal(r))[None, :]
    return procrustes_in_group(q, group)


def tied_heads(spec: ArchSpec, state: Mapping[str, torch.Tensor], config: Any, prefix: str) -> dict[str, str]:
    """``{head weight name: embedding name}`` for the LM heads the config ties to the input embedding."""
    if not getattr(config, "tie_word_embeddings", False) or not spec.embeddings:
        return {}
    emb = prefix + spec.embeddings[0] + ".weight"
    lm = any("LM" in a for a in getattr(config, "architectures", None) or ())  # saved once, as the embedding
    out = {}
    for h in spec.head_paths(prefix):
        if h.kind == "in" and h.path.endswith("lm_head") and emb in state and (lm or h.path + ".weight" in state):
            out[h.path + ".weight"] = emb
    return out


def _scale_heads(out: State, spec: ArchSpec, config: Any, prefix: str, scale: torch.Tensor) -> bool:
    """Heads reading the final norm take ``H diag(scale)`` in ``out``; whether a tied LM head had to be untied.

    A tied head is untied (given its own tensor) unless ``scale`` is all ones: it and the input embedding differ then.
    """
    ties = tied_heads(spec, out, config, prefix)
    untied = bool(ties) and not bool((scale == 1).all())
    for name, emb in ties.items():
        if untied and name not in out:  # a safetensors checkpoint stores the tied head once, as the embedding
            out[name] = out[emb].clone()
    for h in spec.head_paths(prefix):
        if h.kind == "in" and h.path + ".weight" in out and (h.path + ".weight" not in ties or untied):
            t = out[h.path + ".weight"]
            out[h.path + ".weight"] = (t.to(torch.float64) * scale[None, :]).to(t.dtype)
    return untied


def _module_norms(spec: ArchSpec, config: Any, prefix: str) -> list[tuple[Any, str]]:
    """Every module with the path of the norm its readers read."""
    out = []
    for ref in spec.modules(config):
        path = spec.norm_paths(ref.layer, prefix, ref.stack).get(ref.kind)
        if path is None:
            raise UnsupportedArchitecture(f"{spec.family}: module {ref.key} reads no norm of its own")
        out.append((ref, path))
    return out


def _fold_into(w: Weights, roles: tuple[str, ...], gain: torch.Tensor, bias: torch.Tensor | None, where: str) -> None:
    """Readers ``W -> W diag(g)``, ``b -> b + W beta`` in place of ``w`` (new tensors)."""
    for r in roles:
        if r not in w:
            continue
        t = w[r].to(torch.float64)
        if bias is not None and bool(bias.any()):
            if r + "_bias" not in w:
                raise UnsupportedArchitecture(f"{where}: {r} has no bias to take the norm's bias; cannot fold")
            w[r + "_bias"] = (w[r + "_bias"].to(torch.float64) + t @ bias.to(torch.float64)).to(w[r + "_bias"].dtype)
        w[r] = (t * gain.to(torch.float64)[None, :]).to(w[r].dtype)


def fold_norms(
    state: Mapping[str, torch.Tensor], spec: ArchSpec, config: Any, prefix: str | None = None
) -> tuple[State, bool]:
    """The same model with every norm's gain (and LayerNorm bias) moved into the layers that read it.

    Args:
        state: ``{stored name: tensor}`` of the whole model.
        spec: The family spec (a pre-norm family, see :func:`check_supported`).
        config: HF config.
        prefix: Base-model prefix (detected when None).

    Returns:
        ``(new state, untied)``: per-layer norms with gain 1 and bias 0, the final norm with gain 1 and bias
        ``b / g``, readers and heads scaled; ``untied`` is True when a tied LM head became its own tensor (set
        ``config.tie_word_embeddings = False`` when saving).

    Raises:
        UnsupportedArchitecture: a family whose norms cannot be folded, a reader without a bias for a norm bias, or
            a final-norm gain with a zero entry.
    """
    check_supported(spec)
    prefix = spec.detect_prefix(state) if prefix is None else prefix
    out: State = dict(state)
    for ref, norm in _module_norms(spec, config, prefix):
        w = spec.read_module(out.__getitem__, out.__contains__, ref, config, prefix)
        gain, bias = state[norm + ".weight"], state.get(norm + ".bias")
        _fold_into(w, READERS[ref.kind], gain, bias, f"{spec.family} {ref.key}")
        out.update(spec.write_module(w, ref, config, prefix))
        out[norm + ".weight"] = torch.ones_like(gain)
        if bias is not None:
            out[norm + ".bias"] = torch.zeros_like(bias)
    final = prefix + spec.final_norm if spec.final_norm else None
    if final is None or final + ".weight" not in out:
        return out, False
    gain, bias = out[final + ".weight"].to(torch.float64), out.get(final + ".bias")
    if bool((gain == 0).any()):
        raise UnsupportedArchitecture(f"{spec.family}: the final norm {final} has zero gains; cannot fold it")
    untied = _scale_heads(out, spec, config, prefix, gain)
    out[final + ".weight"] = torch.ones_like(out[final + ".weight"])
    if bias is not None:
        out[final + ".bias"] = (bias.to(torch.float64) / gain).to(bias.dtype)
    return out, untied


def _norm_names(spec: ArchSpec, config: Any, prefix: str) -> set[str]:
    names = {n + suffix for _, n in _module_norms(spec, config, prefix) for suffix in (".weight", ".bias")}
    if spec.final_norm:
        names |= {prefix + spec.final_norm + ".weight", prefix + spec.final_norm + ".bias"}
    return names


def rotate_residual(
    state: Mapping[str, torch.Tensor], spec: ArchSpec, config: Any, rot: torch.Tensor, prefix: str | None = None
) -> State:
    """Apply ``x' = x O`` to a whole FOLDED model (:func:`fold_norms`): embeddings, modules, norms' biases, heads.

    Args:
        state: The folded model's tensors (norm gains 1).
        spec: The family spec.
        config: HF config.
        rot: (d_model, d_model) orthogonal, in the family's group (:func:`check_supported`).
        prefix: Base-model prefix (detected when None).

    Returns:
        A new state; tensors off the stream by reference.

    Raises:
        ValueError: the norms are not folded.
    """
    check_supported(spec)
    prefix = spec.detect_prefix(state) if prefix is None else prefix
    rot = rot.to(torch.float64)
    gains = [n for n in _norm_names(spec, config, prefix) if n.endswith(".weight") and n in state]
    if any(not bool((state[n] == 1).all()) for n in gains):
        raise ValueError(f"{spec.family}: fold the norms (fold_norms) before rotating the residual stream")
    out: State = dict(state)
    part = ResidualOrthogonal(rot)
    for ref in spec.modules(config):
        w = spec.read_module(state.__getitem__, state.__contains__, ref, config, prefix)
        out.update(spec.write_module(part.apply(w), ref, config, prefix))
    norms = _norm_names(spec, config, prefix)
    for name, action in residual_plan(spec, list(state), config, prefix).items():
        out[name] = _rotate(state[name], name in norms and name.endswith(".weight"), action, rot)
    return out


def _rotate(t: torch.Tensor, gain: bool, action: str, rot: torch.Tensor) -> torch.Tensor:
    """One tensor outside the modules under ``x' = x O`` (actions of :func:`residual_plan`).

    A folded norm's gain (all ones) stays; its bias, like every vector added to the stream, becomes ``b O``.
    """
    if gain:
        return t
    x = t.to(torch.float64)
    if action == "emb" and t.dim() == 4:  # ViT patch convolution (d, c, h, w): output channels in the stream
        y = torch.einsum("dk,d...->k...", rot, x)
    elif action in ("emb", "last", "cols") or t.dim() == 1:  # embeddings, readers on top, biases: x O
        y = x @ rot
    elif action == "first":  # rows written into the stream (an embedding projection): O^T W
        y = rot.T @ x
    else:  # both: a d -> d map on top
        y = rot.T @ x @ rot
    return y.to(t.dtype).contiguous()


def unfold_into(
    state: Mapping[str, torch.Tensor],
    target: Mapping[str, torch.Tensor],
    spec: ArchSpec,
    config: Any,
    prefix: str | None = None,
) -> tuple[State, bool]:
    """Give a folded model ``target``'s per-layer norms and final gain (the same function, ``target``'s norms).

    Readers take ``W diag(1 / g)`` and ``b - W' beta``; the heads ``H diag(1 / g_final)``; the final norm's bias
    becomes ``c g_final`` (``c``: the folded bias). A matched model unfolded into its anchor's norms shares them
    exactly, so the two merge tensor by tensor. Returns ``(new state, untied)`` as :func:`fold_norms` does.

    Raises:
        UnsupportedArchitecture: a target gain with a zero entry.
    """
    prefix = spec.detect_prefix(state) if prefix is None else prefix
    out: State = dict(state)
    for ref, norm in _module_norms(spec, config, prefix):
        gain, bias = target[norm + ".weight"].to(torch.float64), target.get(norm + ".bias")
        if bool((gain == 0).any()):
            raise UnsupportedArchitecture(f"{spec.family}: {norm} has zero gains; cannot move another model's there")
        w = spec.read_module(out.__getitem__, out.__contains__, ref, config, prefix)
        _fold_into(w, READERS[ref.kind], 1.0 / gain, None, f"{spec.family} {ref.key}")  # W / g
        if bias is not None and bool(bias.any()):  # b - (W / g) beta
            _fold_into(w, READERS[ref.kind], torch.ones_like(gain), -bias.to(torch.float64), f"{spec.family} {ref.key}")
        out.update(spec.write_module(w, ref, config, prefix))
        out[norm + ".weight"] = target[norm + ".weight"].clone()
        if bias is not None:
            out[norm + ".bias"] = bias.clone()
    final = prefix + spec.final_norm if spec.final_norm else None
    if final is None or final + ".weight" not in out:
        return out, False
    gain = target[final + ".weight"].to(torch.float64)
    untied = _scale_heads(out, spec, config, prefix, 1.0 / gain)
    if final + ".bias" in out:
        out[final + ".bias"] = (out[final + ".bias"].to(torch.float64) * gain).to(out[final + ".bias"].dtype)
    out[final + ".weight"] = target[final + ".weight"].clone()
    return out, untied
