"""Exact symmetry transforms of one attention or FFN module, as immutable values.

Every transform acts on *canonical module weights* (``dict[role, Tensor]``, ``nn.Linear`` layout
``(out, in)``, see :mod:`symfuse.arch.spec`) and returns NEW tensors. Head layout: query head ``h`` owns rows
``h*dh:(h+1)*dh`` of ``q`` / ``pos_q`` (and ``q_bias``) and the same columns of ``o``; KV group ``g`` owns rows
``g*dh:(g+1)*dh`` of ``k`` / ``v`` / ``pos_k``; query head ``h`` belongs to group ``h // G`` (``G`` = query heads
per KV head; ``G = 1`` without GQA). Per-group tensors below have a leading ``n_kv`` axis.

Conventions (``x`` = a head's vector in the OLD basis, ``x'`` in the NEW one):

* :class:`HeadPermutation` ``perm`` (n_kv,): new group ``j`` = old group ``perm[j]``; query heads move with
  their group (new head ``j*G + r`` = old head ``perm[j]*G + r``).
* :class:`QKRotation` ``rot`` (n_kv, dh, dh): ``q_h' = R_g q_h``, ``k_g' = R_g k_g`` (rows, biases, and
  ``pos_q`` / ``pos_k`` exactly like ``q`` / ``k``). Scores ``q^T k`` are unchanged for orthogonal ``R``; with
  RoPE the matcher only produces ``R`` that commute with it (2x2 rotations on the pairs ``(i, i + dh/2)``).
* :class:`QKScaling` ``scale`` (n_kv, dh): ``q' = diag(s) q``, ``k' = diag(1/s) k``. Per-head constant without
  RoPE, per frequency pair with RoPE (so it commutes with the rotations above).
* :class:`VORotation` ``rot`` (n_kv, dh, dh): ``v_g' = R_g v_g``, ``o_h' = o_h R_g^T``.
* :class:`VOScaling` ``scale`` (n_kv, dh): ``v' = diag(s) v``, ``o_h' = o_h diag(1/s)``.
* :class:`FFNPermutation` ``perm`` (d_ffn,): new neuron ``j`` = old neuron ``perm[j]`` (rows of up/gate and their
  biases, columns of down).

``apply_to_gram(role, G)``: ``G = sum_t x_t x_t^T`` (any positive weighting, e.g. a mean) of the INPUT ``x_t``
(in_features) of the linear layer ``role``. A transform changes that input to ``x' = T x``, so it returns
``T G T^T``: for ``role="o"`` (attention output projection, input = concatenated head outputs) head block
``(i, j)`` of the result is ``S_i R_i G[perm(i), perm(j)] R_j^T S_j`` (``R`` = :class:`VORotation`, ``S`` =
diag of :class:`VOScaling`, ``perm`` = :class:`HeadPermutation` on heads). Written with ``W_O' = W_O Q`` where
``Q = R^T`` this is the familiar ``Q^T G Q`` block. For ``role="down"``: ``P G P^T``, i.e. ``G[perm][:, perm]``.
Other roles' inputs (the residual stream) are unchanged by per-module transforms: ``G`` is returned as is.
So "transformed Gram == Gram recollected on the transformed model" holds exactly.

:class:`ModuleTransform` bundles parts for one module (``key`` = ``ModuleRef.key``), applied in order. New
transform kinds (e.g. a residual-stream permutation) subclass :class:`Transform` and call
:func:`register_transform`; save / load and composition then handle them too.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
from typing_extensions import override

from symfuse.io import TensorFile, save_safetensors

Weights = dict[str, torch.Tensor]
_REGISTRY: dict[str, type[Transform]] = {}


def register_transform(cls: type[Transform]) -> type[Transform]:
    """Class decorator: make a :class:`Transform` subclass loadable by its ``name``."""
    _REGISTRY[cls.name] = cls
    return cls


def transform_class(name: str) -> type[Transform]:
    """The :class:`Transform` subclass of parts named ``name``.

    A part of a registered symmetry kind whose module was not imported yet (a transforms file read in another
    process) is loaded by importing the kind's code: its finder or draw function's module defines the part.

    Raises:
        ValueError: no registered class or kind produces ``name``.
    """
    if name not in _REGISTRY:
        from symfuse.symmetry.registry import kind_of_part

        kind = kind_of_part(name)
        for what in ("weights", "activations", "draw"):
            if kind is not None and name not in _REGISTRY and getattr(kind, what) is not None:
                kind.fn(what)  # imports the module that registers the part's class
    if name not in _REGISTRY:
        raise ValueError(f"unknown transform part {name!r} (known: {sorted(_REGISTRY)})")
    return _REGISTRY[name]


def _work_dtype(t: torch.Tensor) -> torch.dtype:
    # fp32/fp64 weights are transformed in float64 (exactness); half types in float32 (output is half anyway)
    return torch.float64 if t.dtype in (torch.float32, torch.float64) else torch.float32


class Transform:
    """Base class of every transform part (see the module docstring for conventions)."""

    name: ClassVar[str] = ""

    def apply(self, weights: Mapping[str, torch.Tensor]) -> Weights:
        """Return new canonical weights with the transform applied (roles it does not touch are copied by ref)."""
        raise NotImplementedError

    def inverse(self) -> Transform:
        """The transform undoing this one."""
        raise NotImplementedError

    def apply_to_gram(self, role: str, gram: torch.Tensor) -> torch.Tensor:
        """``T G T^T`` for the input of linear layer ``role`` (unchanged input: ``gram`` itself)."""
        return gram

    def condition(self) -> float:
        """``cond(M)`` of a map ``M`` (1: permutations, rotations): how much it may amplify the weights' rounding."""
        return 1.0

    def tensors(self) -> dict[str, torch.Tensor]:
        """State as named tensors (for safetensors)."""
        raise NotImplementedError

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor]) -> Transform:
        """Inverse of :meth:`tensors`."""
        return cls(**tensors)  # type: ignore[call-arg]

    def merge(self, earlier: Transform) -> Transform | None:
        """``self`` after ``earlier`` as ONE part of this type, or None when they do not fuse."""
        return None

    def to(self, device: torch.device | str) -> Transform:
        """The part with its tensors on ``device`` (``self`` when they are there already)."""
        state = self.tensors()
        device = torch.device(device)
        if all(t.device == device for t in state.values()):
            return self
        return type(self).from_tensors({k: v.to(device) for k, v in state.items()})

    def compose(self, earlier: Transform) -> ModuleTransform:
        """``self ∘ earlier`` (apply ``earlier`` first)."""
        return ModuleTransform("", (earlier, self)).simplify()


# ------------------------------------------------------------------------------------------- helpers
def _group_rows(w: torch.Tensor, n_groups: int) -> torch.Tensor:
    """(n_groups*dh, ...) -> (n_groups, dh, ...) view."""
    return w.reshape(n_groups, w.shape[0] // n_groups, *w.shape[1:])


def _rotate_rows(w: torch.Tensor, mat: torch.Tensor, per_head: bool) -> torch.Tensor:
    """Left-multiply each head's rows by its group's ``mat`` (n_kv, dh, dh); ``w`` (heads*dh, ...)."""
    n_kv, dh = mat.shape[0], mat.shape[1]
    wd = _work_dtype(w)
    heads = w.shape[0] // dh
    g = heads // n_kv if per_head else 1
    x = w.to(wd).reshape(n_kv, g, dh, -1)  # (n_kv, G, dh, cols)
    y = torch.einsum("nab,ngbc->ngac", mat.to(wd), x)
    return y.reshape(w.shape).to(w.dtype)


def _scale_rows(w: torch.Tensor, scale: torch.Tensor, per_head: bool) -> torch.Tensor:
    n_kv, dh = scale.shape
    wd = _work_dtype(w)
    g = (w.shape[0] // dh) // n_kv if per_head else 1
    x = w.to(wd).reshape(n_kv, g, dh, -1) * scale.to(wd)[:, None, :, None]
    return x.reshape(w.shape).to(w.dtype)


def _rows_of(weights: Mapping[str, torch.Tensor], roles: Sequence[str]) -> list[str]:
    return [r for r in roles if r in weights]


def map_qk(weights: Mapping[str, torch.Tensor], q_map: torch.Tensor, k_map: torch.Tensor) -> Weights:
    """Query heads' rows (bias, ``pos_q``) times their group's ``q_map``, the keys' times ``k_map`` (n_kv, dh, dh)."""
    out = dict(weights)
    for r in _rows_of(weights, ("q", "q_bias", "pos_q", "pos_q_bias")):
        out[r] = _rotate_rows(weights[r], q_map, per_head=True)
    for r in _rows_of(weights, ("k", "k_bias", "pos_k", "pos_k_bias")):
        out[r] = _rotate_rows(weights[r], k_map, per_head=False)
    return out


def map_vo(weights: Mapping[str, torch.Tensor], v_map: torch.Tensor, o_map: torch.Tensor) -> Weights:
    """The values' rows (bias) times ``v_map``, each query head's rows of ``o^T`` times ``o_map`` (n_kv, dh, dh)."""
    out = dict(weights)
    for r in _rows_of(weights, ("v", "v_bias")):
        out[r] = _rotate_rows(weights[r], v_map, per_head=False)
    out["o"] = _rotate_rows(weights["o"].t(), o_map, per_head=True).t().contiguous()
    return out


# ------------------------------------------------------------------------------------ attention parts
@register_transform
@dataclass(frozen=True, eq=False)
class HeadPermutation(Transform):
    """Permutation of KV groups (query heads move with their group): new group j = old group ``perm[j]``."""

    perm: torch.Tensor  # (n_kv,) int64
    name: ClassVar[str] = "head_perm"

    def _head_index(self, n_heads: int) -> torch.Tensor:
        g = n_heads // self.perm.numel()
        return (self.perm[:, None] * g + torch.arange(g, device=self.perm.device)[None, :]).reshape(-1)  # (n_heads,)

    @override
    def apply(self, weights: Mapping[str, torch.Tensor]) -> Weights:
        out = dict(weights)
        n_kv = self.perm.numel()
        dh = weights["k"].shape[0] // n_kv
        n_heads = weights["q"].shape[0] // dh
        hidx = self._head_index(n_heads)
        for role, idx in (("q", hidx), ("pos_q", hidx), ("k", self.perm), ("v", self.perm), ("pos_k", self.perm)):
            for r in (role, role + "_bias"):
                if r in weights:
                    w = weights[r]
                    out[r] = _group_rows(w, idx.numel())[idx].reshape(w.shape)
        o = weights["o"]
        out["o"] = o.reshape(o.shape[0], n_heads, dh)[:, hidx].reshape(o.shape)
        if "head_table" in weights:  # T5 relative bias (buckets, n_heads): one column per query head
            out["head_table"] = weights["head_table"][:, hidx]
        return out

    @override
    def inverse(self) -> HeadPermutation:
        return HeadPermutation(torch.argsort(self.perm))

    @override
    def apply_to_gram(self, role: str, gram: torch.Tensor) -> torch.Tensor:
        if role != "o":
            return gram
        n = gram.shape[-1]
        # group block index -> element index: each group holds n/n_kv consecutive elements
        per = n // self.perm.numel()
        idx = (self.perm[:, None] * per + torch.arange(per, device=self.perm.device)[None, :]).reshape(-1)
        return gram[..., idx, :][..., :, idx]

    @override
    def tensors(self) -> dict[str, torch.Tensor]:
        return {"perm": self.perm}

    @override
    def merge(self, earlier: Transform) -> Transform | None:
        if isinstance(earlier, HeadPermutation):
            return HeadPermutation(earlier.perm[self.perm])
        return None


@dataclass(frozen=True, eq=False)
class _GroupMap(Transform):
    """Per-group square map; subclasses say which roles it multiplies."""

    rot: torch.Tensor  # (n_kv, dh, dh) float64

    @override
    def inverse(self) -> _GroupMap:
        return type(self)(self.rot.transpose(-1, -2).contiguous())

    @override
    def tensors(self) -> dict[str, torch.Tensor]:
        return {"rot": self.rot}

    @override
    def merge(self, earlier: Transform) -> Transform | None:
        if type(earlier) is type(self):
            return type(self)(self.rot @ earlier.rot)  # type: ignore[attr-defined]
        return None


@register_transform
@dataclass(frozen=True, eq=False)
class QKRotation(_GroupMap):
    """Per-KV-group orthogonal map on queries and keys: ``q_h' = R_g q_h``, ``k_g' = R_g k_g``."""

    name: ClassVar[str] = "qk_rot"

    @override
    def apply(self, weights: Mapping[str, torch.Tensor]) -> Weights:
        return map_qk(weights, self.rot, self.rot)


@register_transform
@dataclass(frozen=True, eq=False)
class VORotation(_GroupMap):
    """Per-KV-group orthogonal map on values and output: ``v_g' = R_g v_g``, ``o_h' = o_h R_g^T``."""

    name: ClassVar[str] = "vo_rot"

    @override
    def apply(self, weights: Mapping[str, torch.Tensor]) -> Weights:
        return map_vo(weights, self.rot, self.rot)

    @override
    def apply_to_gram(self, role: str, gram: torch.Tensor) -> torch.Tensor:
        return head_block_gram(self.rot, gram) if role == "o" else gram


def head_block_gram(mat: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """``T G T^T`` for the Gram ``G`` of o_proj's input, ``T`` = each query head's block mapped by its group's ``mat``.

    Args:
        mat: (n_kv, dh, dh) per-group map of the head outputs (``x_h' = M_g x_h``).
        gram: (n_heads*dh, n_heads*dh) Gram of the concatenated head outputs.
    """
    n_kv, dh = mat.shape[0], mat.shape[1]
    g = gram.shape[-1] // (n_kv * dh)
    t = torch.block_diag(*mat.to(torch.float64).repeat_interleave(g, dim=0))  # (n, n)
    return (t @ gram.to(torch.float64) @ t.T).to(gram.dtype)


@dataclass(frozen=True, eq=False)
class _GroupScale(Transform):
    scale: torch.Tensor  # (n_kv, dh) float64, positive

    @override
    def inverse(self) -> _GroupScale:
        return type(self)(1.0 / self.scale)

    @override
    def tensors(self) -> dict[str, torch.Tensor]:
        return {"scale": self.scale}

    @override
    def merge(self, earlier: Transform) -> Transform | None:
        if type(earlier) is type(self):
            return type(self)(self.scale * earlier.scale)  # type: ignore[attr-defined]
        return None


@register_transform
@dataclass(frozen=True, eq=False)
class QKScaling(_GroupScale):
    """Per-group positive scales: ``q' = diag(s) q``, ``k' = diag(1/s) k`` (pos_q / pos_k likewise)."""

    name: ClassVar[str] = "qk_scale"

    @override
    def apply(self, weights: Mapping[str, torch.Tensor]) -> Weights:
        out = dict(weights)
        for r in _rows_of(weights, ("q", "q_bias", "pos_q", "pos_q_bias")):
            out[r] = _scale_rows(weights[r], self.scale, per_head=True)
        for r in _rows_of(weights, ("k", "k_bias", "pos_k", "pos_k_bias")):
            out[r] = _scale_rows(weights[r], 1.0 / self.scale, per_head=False)
        return out


@register_transform
@dataclass(frozen=True, eq=False)
class VOScaling(_GroupScale):
    """Per-group positive scales: ``v' = diag(s) v``, ``o_h' = o_h diag(1/s)``."""

    name: ClassVar[str] = "vo_scale"

    @override
    def apply(self, weights: Mapping[str, torch.Tensor]) -> Weights:
        out = dict(weights)
        for r in _rows_of(weights, ("v", "v_bias")):
            out[r] = _scale_rows(weights[r], self.scale, per_head=False)
        out["o"] = _scale_rows(weights["o"].t(), 1.0 / self.scale, per_head=True).t().contiguous()
        return out

    @override
    def apply_to_gram(self, role: str, gram: torch.Tensor) -> torch.Tensor:
        if role != "o":
            return gram
        n = gram.shape[-1]
        s = self.scale.repeat_interleave(n // self.scale.numel(), dim=0).reshape(-1).to(torch.float64)
        return (s[:, None] * gram.to(torch.float64) * s[None, :]).to(gram.dtype)


# ------------------------------------------------------------------------------------------ FFN part
@register_transform
@dataclass(frozen=True, eq=False)
class FFNPermutation(Transform):
    """Hidden-neuron permutation: new neuron j = old neuron ``perm[j]`` (gate and up move together)."""

    perm: torch.Tensor  # (d_ffn,) int64
    name: ClassVar[str] = "ffn_perm"

    @override
    def apply(self, weights: Mapping[str, torch.Tensor]) -> Weights:
        out = dict(weights)
        for r in _rows_of(weights, ("up", "up_bias", "gate", "gate_bias")):
            out[r] = weights[r][self.perm]
        out["down"] = weights["down"][:, self.perm]
        return out

    @override
    def inverse(self) -> FFNPermutation:
        return FFNPermutation(torch.argsort(self.perm))

    @override
    def apply_to_gram(self, role: str, gram: torch.Tensor) -> torch.Tensor:
        if role != "down":
            return gram
        return gram[..., self.perm, :][..., :, self.perm]

    @override
    def tensors(self) -> dict[str, torch.Tensor]:
        return {"perm": self.perm}

    @override
    def merge(self, earlier: Transform) -> Transform | None:
        if isinstance(earlier, FFNPermutation):
            return FFNPermutation(earlier.perm[self.perm])
        return None


# --------------------------------------------------------------------------------------- the bundle
@dataclass(frozen=True, eq=False)
class ModuleTransform:
    """The transform of one module (``key`` = ``ModuleRef.key``): ``parts`` applied in order.

    Attributes:
        key: Module key (``L03.attn``), ``""`` when not bound to a module.
        parts: Transform parts, first applied first.
    """

    key: str
    parts: tuple[Transform, ...] = field(default_factory=tuple)

    @property
    def kind(self) -> str:
        """``attn`` or ``ffn`` (from the key)."""
        return self.key.rpartition(".")[2]

    def apply(self, weights: Mapping[str, torch.Tensor]) -> Weights:
        """New canonical weights of the transformed module (computed on the weights' device)."""
        out = dict(weights)
        device = next(iter(out.values())).device if out else None
        for p in self.parts:
            out = (p.to(device) if device is not None else p).apply(out)
        return out

    def to(self, device: torch.device | str) -> ModuleTransform:
        """The transform with every part's tensors on ``device``."""
        return ModuleTransform(self.key, tuple(p.to(device) for p in self.parts))

    def inverse(self) -> ModuleTransform:
        """The transform undoing this one."""
        return ModuleTransform(self.key, tuple(p.inverse() for p in reversed(self.parts)))

    def compose(self, earlier: ModuleTransform | Transform) -> ModuleTransform:
        """``self ∘ earlier``: apply ``earlier`` first, then ``self``."""
        before = earlier.parts if isinstance(earlier, ModuleTransform) else (earlier,)
        key = self.key or (earlier.key if isinstance(earlier, ModuleTransform) else "")
        return ModuleTransform(key, (*before, *self.parts)).simplify()

    def simplify(self) -> ModuleTransform:
        """Fuse adjacent parts of one type (a product of rotations is one rotation, ...)."""
        out: list[Transform] = []
        for p in self.parts:
            fused = p.merge(out[-1]) if out else None
            if fused is not None:
                out[-1] = fused
            else:
                out.append(p)
        return ModuleTransform(self.key, tuple(out))

    def apply_to_gram(self, role: str, gram: torch.Tensor) -> torch.Tensor:
        """Gram of the input of linear layer ``role`` on the transformed model (``T G T^T``; see module doc)."""
        for p in self.parts:
            gram = p.apply_to_gram(role, gram)
        return gram

    def tensors(self) -> dict[str, torch.Tensor]:
        """Flat ``{"<i>.<part name>.<field>": tensor}``."""
        return {f"{i}.{p.name}.{k}": v.contiguous() for i, p in enumerate(self.parts) for k, v in p.tensors().items()}

    @classmethod
    def from_tensors(cls, key: str, tensors: Mapping[str, torch.Tensor]) -> ModuleTransform:
        """Inverse of :meth:`tensors`."""
        by_part: dict[int, tuple[str, dict[str, torch.Tensor]]] = {}
        for flat, t in tensors.items():
            i, name, fld = flat.split(".", 2)
            by_part.setdefault(int(i), (name, {}))[1][fld] = t
        parts = []
        for i in sorted(by_part):
            name, fields = by_part[i]
            parts.append(transform_class(name).from_tensors(fields))
        return cls(key, tuple(parts))


def save_transforms(transforms: Mapping[str, ModuleTransform], file: str | Path) -> Path:
    """Save module transforms into one safetensors file (names ``<module key>/<i>.<part>.<field>``)."""
    flat = {f"{k}/{n}": t for k, mt in transforms.items() for n, t in mt.tensors().items()}
    meta = {"format": "symfuse-transforms", "modules": json.dumps(sorted(transforms))}
    return save_safetensors(flat, file, meta)  # atomic: temp file + fsync + rename


def load_transforms(file: str | Path) -> dict[str, ModuleTransform]:
    """Inverse of :func:`save_transforms` (modules without parts come back as identities)."""
    with TensorFile(file) as f:  # header validated (a bad file is a CheckpointError naming it)
        meta = f.metadata
        tensors = {n: f.get(n) for n in f.keys()}  # noqa: SIM118
    keys = json.loads(meta.get("modules", "[]"))
    grouped: dict[str, dict[str, torch.Tensor]] = {k: {} for k in keys}
    for n, t in tensors.items():
        k, _, rest = n.partition("/")
        grouped.setdefault(k, {})[rest] = t
    return {k: ModuleTransform.from_tensors(k, v) for k, v in grouped.items()}
