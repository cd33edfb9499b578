"""Architecture specs: where each tensor of each attention / FFN module lives, as data.

A family is described once, in ``families/<family>.yaml``; :class:`ArchSpec` is the only place where
Hugging Face tensor names are built. Algorithms never see those names: they see *canonical module
weights*, a ``dict[role, Tensor]`` in ``nn.Linear`` layout ``(out_features, in_features)``, with fused
QKV split and GPT-2 ``Conv1D`` transposed. :meth:`ArchSpec.read_module` and
:meth:`ArchSpec.write_module` convert between the two.

Roles (one vocabulary for every family)::

    attention: q k v o pos_q pos_k        (+ "<role>_bias")
        q:  (n_heads    * head_dim, d_model)
        k:  (n_kv_heads * head_dim, d_model)     pos_q / pos_k: DeBERTa relative projections
        v:  (n_kv_heads * head_dim, d_model)
        o:  (d_model, n_heads * head_dim)
    ffn:       up gate down                (+ "<role>_bias")
        up / gate: (d_ffn, d_model)              down: (d_model, d_ffn)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from symfuse.errors import SymfuseError

ModuleKind = Literal["attn", "ffn"]
ModuleWeights = dict[str, torch.Tensor]

ATTN_ROLES = ("q", "k", "v", "o", "pos_q", "pos_k")
FFN_ROLES = ("up", "gate", "down")


@dataclass(frozen=True, order=True)
class ModuleRef:
    """One attention or FFN module of one layer; ``key`` names tasks and artifacts (``L07.attn``)."""

    layer: int
    kind: ModuleKind

    @property
    def key(self) -> str:
        """Stable short name, e.g. ``L07.attn``."""
        return f"L{self.layer:02d}.{self.kind}"

    @classmethod
    def parse(cls, key: str) -> ModuleRef:
        """Inverse of :attr:`key`.

        Raises:
            ValueError: if ``key`` is not of the form ``L<int>.<attn|ffn>``.
        """
        layer, _, kind = key.partition(".")
        if not layer.startswith("L") or not layer[1:].isdigit() or kind not in ("attn", "ffn"):
            raise ValueError(f"not a module key: {key!r} (expected e.g. 'L07.attn' or 'L07.ffn')")
        return cls(int(layer[1:]), kind)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Geometry:
    """Shapes of one model, read from its HF config (never hard-coded)."""

    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ffn: int
    rope: bool
    gated: bool
    share_att_key: bool = False
    pos_proj: bool = False  # DeBERTa with separate pos_key_proj / pos_query_proj

    @property
    def group_size(self) -> int:
        """Query heads per KV head (1 without GQA)."""
        return self.n_heads // self.n_kv_heads


@dataclass(frozen=True)
class AttentionSpec:
    """Where Q/K/V/O live inside a layer (templates relative to the layer prefix)."""

    o: str
    q: str | None = None
    k: str | None = None
    v: str | None = None
    qkv: str | None = None  # fused (GPT-2 c_attn): output is [q | k | v]
    pos_q: str | None = None
    pos_k: str | None = None


@dataclass(frozen=True)
class FFNSpec:
    """Where the FFN projections live; ``gate`` only for gated MLPs."""

    up: str
    down: str
    gate: str | None = None
    activation_key: str = "hidden_act"


@dataclass(frozen=True)
class NormSpec:
    """The two per-layer norms; ``placement`` is ``pre`` (before the sublayer) or ``post``."""

    kind: Literal["layernorm", "rmsnorm"]
    placement: Literal["pre", "post"]
    attn: str
    ffn: str


@dataclass(frozen=True)
class HeadSpec:
    """A tensor outside the layers that reads or writes the residual stream (pooler, classifier, LM head, ...).

    ``path`` is relative to the whole model; ``{base}`` stands for the base-model prefix (``""`` or ``"bert."``).
    ``kind`` says how a residual-stream change of basis reaches it: ``in`` (a Linear reading the stream:
    input columns), ``in_out`` (a d->d Linear whose output is read by an ``in`` entry or a tied decoder, followed
    only by elementwise maps or norms: rows, columns and bias), ``norm`` (weight and bias). Entries absent from a
    checkpoint are skipped.
    """

    path: str
    kind: Literal["in", "in_out", "norm"]


@dataclass(frozen=True)
class ArchSpec:
    """One architecture family, parsed from its YAML file.

    Attributes:
        family: Family name (``bert``, ``llama``, ...).
        model_types: ``config.model_type`` values this spec covers.
        base_prefix: Prefix that task-head models put before base-model names (``bert``).
        layer: Template of a layer's prefix, e.g. ``encoder.layer.{i}``.
        attention: Attention tensor locations.
        ffn: FFN tensor locations.
        norm: Per-layer norm locations.
        embeddings: Embedding modules / parameters that write the residual stream.
        embedding_norm: Norm applied to the embeddings (post-LN encoders), if any.
        final_norm: Final norm (pre-LN models), if any.
        rope: Rotary position embeddings on Q/K (rotate_half pairing of i and i + d/2).
        conv1d: Weights stored as (in, out) (GPT-2 ``Conv1D``).
        relative_embeddings: DeBERTa relative position embedding table, if any.
        relative_norm: Norm applied to the relative embeddings, if any.
        heads: Pooler / task-head / LM-head tensors touching the residual stream (see :class:`HeadSpec`).
        checkpoint_variants: The same family under the names ``save_pretrained`` writes, where those differ from
            the in-memory module names (``checkpoint_layout`` in the YAML); readers pick the one that matches.
    """

    family: str
    model_types: tuple[str, ...]
    base_prefix: str
    layer: str
    attention: AttentionSpec
    ffn: FFNSpec
    norm: NormSpec
    embeddings: tuple[str, ...] = ()
    embedding_norm: str | None = None
    final_norm: str | None = None
    rope: bool = False
    conv1d: bool = False
    relative_embeddings: str | None = None
    relative_norm: str | None = None
    heads: tuple[HeadSpec, ...] = ()
    checkpoint_variants: tuple[ArchSpec, ...] = ()
    extra: Mapping[str, Any] = field(default_factory=dict)

    # ----------------------------------------------------------------- shapes
    def geometry(self, config: Any) -> Geometry:
        """Read the model's shapes from an HF config.

        Args:
            config: A ``transformers.PretrainedConfig`` (or anything with the same attributes).

        Returns:
            The model's :class:`Geometry`.
        """
        d_model = int(config.hidden_size)
        n_heads = int(config.num_attention_heads)
        n_kv = int(getattr(config, "num_key_value_heads", None) or n_heads)
        head_dim = int(getattr(config, "head_dim", None) or d_model // n_heads)
        d_ffn = getattr(config, "intermediate_size", None) or getattr(config, "hidden_dim", None)
        if d_ffn is None:  # GPT-2: n_inner, default 4 * d
            d_ffn = getattr(config, "n_inner", None) or 4 * d_model
        pos_types = getattr(config, "pos_att_type", None) or ()
        relative = bool(getattr(config, "relative_attention", False)) and bool(pos_types)
        share = bool(getattr(config, "share_att_key", False))
        return Geometry(
            n_layers=int(config.num_hidden_layers),
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=n_kv,
            head_dim=head_dim,
            d_ffn=int(d_ffn),
            rope=self.rope,
            gated=self.ffn.gate is not None,
            share_att_key=share,
            pos_proj=self.attention.pos_q is not None and relative and not share,
        )

    def modules(self, config: Any) -> list[ModuleRef]:
        """Every attention and FFN module, in layer order (attention first)."""
        n = self.geometry(config).n_layers
        return [ModuleRef(i, kind) for i in range(n) for kind in ("attn", "ffn")]

    # ------------------------------------------------------------------ names
    def for_checkpoint(self, names: Iterable[str]) -> tuple[ArchSpec, str]:
        """The spec (this one or a checkpoint variant) whose names a checkpoint uses, with its prefix.

        Raises:
            SymfuseError: if neither layout matches (the message of :meth:`detect_prefix`).
        """
        names = set(names)
        for variant in self.checkpoint_variants:
            try:
                return variant, variant.detect_prefix(names)
            except SymfuseError:
                continue
        return self, self.detect_prefix(names)

    def detect_prefix(self, names: Iterable[str]) -> str:
        """Find the prefix before base-model names in a checkpoint (``""`` or ``"bert."``).

        Args:
            names: All tensor names of the checkpoint.

        Raises:
            SymfuseError: if layer 0's output projection is found under neither prefix.
        """
        names = set(names)
        probe = self._join(self.layer.format(i=0), self.attention.o) + ".weight"
        for prefix in ("", self.base_prefix + "."):
            if prefix + probe in names:
                return prefix
        raise SymfuseError(
            f"checkpoint does not look like a {self.family} model: neither {probe!r} nor "
            f"{self.base_prefix + '.' + probe!r} is among its tensors"
        )

    def module_paths(self, ref: ModuleRef, config: Any, prefix: str = "") -> dict[str, str]:
        """HF module paths (without ``.weight``) of one module, by role (``qkv`` for fused QKV)."""
        geo = self.geometry(config)
        base = prefix + self.layer.format(i=ref.layer)
        if ref.kind == "attn":
            a = self.attention
            roles = {"q": a.q, "k": a.k, "v": a.v, "qkv": a.qkv, "o": a.o}
            if geo.pos_proj:
                roles.update(pos_q=a.pos_q, pos_k=a.pos_k)
        else:
            roles = {"up": self.ffn.up, "gate": self.ffn.gate, "down": self.ffn.down}
        return {r: self._join(base, p) for r, p in roles.items() if p is not None}

    def tensor_names(self, ref: ModuleRef, config: Any, prefix: str = "") -> dict[str, str]:
        """Stored tensor names of one module: ``{"q": "...query.weight", "q_bias": ...}``.

        Bias names are listed whether or not the checkpoint has them; readers skip absent ones.
        """
        out = {}
        for role, path in self.module_paths(ref, config, prefix).items():
            out[role] = path + ".weight"
            out[role + "_bias"] = path + ".bias"
        return out

    def norm_paths(self, layer: int, prefix: str = "") -> dict[str, str]:
        """Module paths of one layer's norms, by sublayer (``attn`` / ``ffn``)."""
        base = prefix + self.layer.format(i=layer)
        return {"attn": self._join(base, self.norm.attn), "ffn": self._join(base, self.norm.ffn)}

    def head_paths(self, prefix: str = "") -> list[HeadSpec]:
        """:attr:`heads` with ``{base}`` resolved to ``prefix`` (module paths, without ``.weight``)."""
        return [HeadSpec(h.path.replace("{base}", prefix), h.kind) for h in self.heads]

    # ----------------------------------------------------- canonical weights
    def read_module(
        self,
        get: Callable[[str], torch.Tensor],
        has: Callable[[str], bool],
        ref: ModuleRef,
        config: Any,
        prefix: str = "",
    ) -> ModuleWeights:
        """Load one module's tensors in canonical layout (see the module docstring).

        Args:
            get: Returns a stored tensor by name (lazy readers load only what is asked for).
            has: Tells whether a stored tensor exists.
            ref: The module.
            config: HF config of the model.
            prefix: Name prefix from :meth:`detect_prefix`.

        Returns:
            New tensors by role; biases only where the checkpoint has them.
        """
        geo = self.geometry(config)
        out: ModuleWeights = {}
        for role, name in self.tensor_names(ref, config, prefix).items():
            if not has(name):
                continue
            t = get(name)
            is_bias = role.endswith("_bias")
            if self.conv1d and not is_bias:
                t = t.t()  # Conv1D stores (in, out)
            if role.startswith("qkv"):
                sizes = [geo.n_heads * geo.head_dim, geo.n_kv_heads * geo.head_dim, geo.n_kv_heads * geo.head_dim]
                suffix = role[3:]
                for r, part in zip("qkv", torch.split(t, sizes, dim=0), strict=True):
                    out[r + suffix] = part.contiguous()
            else:
                out[role] = t.contiguous()
        missing = [r for r in (("q", "k", "v", "o") if ref.kind == "attn" else ("up", "down")) if r not in out]
        if missing:
            raise SymfuseError(f"{self.family} module {ref.key}: tensors for roles {missing} not found")
        return out

    def write_module(
        self, weights: Mapping[str, torch.Tensor], ref: ModuleRef, config: Any, prefix: str = ""
    ) -> dict[str, torch.Tensor]:
        """Inverse of :meth:`read_module`: canonical tensors to stored names and layout.

        Args:
            weights: Canonical tensors by role (as returned by :meth:`read_module`).
            ref: The module.
            config: HF config of the model.
            prefix: Name prefix from :meth:`detect_prefix`.

        Returns:
            ``{stored name: tensor}`` for every role present in ``weights``.
        """
        names = self.tensor_names(ref, config, prefix)
        w = dict(weights)
        if "qkv" in names:
            for suffix in ("", "_bias"):
                parts = [w.pop(r + suffix, None) for r in "qkv"]
                if all(p is not None for p in parts):
                    w["qkv" + suffix] = torch.cat(parts, dim=0)
        out = {}
        for role, t in w.items():
            if self.conv1d and not role.endswith("_bias"):
                t = t.t()
            out[names[role]] = t.contiguous()
        return out

    @staticmethod
    def _join(*parts: str) -> str:
        return ".".join(p for p in parts if p)
