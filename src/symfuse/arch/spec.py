"""Architecture specs: where each tensor of each attention / FFN module lives, as data.

A family is described once, in ``families/<family>.yaml``; :class:`ArchSpec` is the only place where
Hugging Face tensor names are built. Algorithms never see those names: they see *canonical module
weights*, a ``dict[role, Tensor]`` in ``nn.Linear`` layout ``(out_features, in_features)``, with fused
QKV split and GPT-2 ``Conv1D`` transposed. :meth:`ArchSpec.read_module` and
:meth:`ArchSpec.write_module` convert between the two.

Roles (one vocabulary for every family)::

    attention: q k v o pos_q pos_k q_norm k_norm   (+ "<role>_bias")
        q:  (n_heads    * head_dim, d_model)
        k:  (n_kv_heads * head_dim, d_model)     pos_q / pos_k: DeBERTa relative projections
        v:  (n_kv_heads * head_dim, d_model)
        o:  (d_model, n_heads * head_dim)
        q_norm / k_norm: (head_dim,)             Qwen3 per-head RMSNorm weights (shared by all heads)
    ffn:       up gate down                (+ "<role>_bias")
        up / gate: (d_ffn, d_model)              down: (d_model, d_ffn)

Fused tensors are ROW slices of one stored tensor, named once in :data:`FUSED`: ``qkv`` (GPT-2 ``c_attn``,
Phi-3 ``qkv_proj``) is ``[q | k | v]``, ``gate_up`` (Phi-3 ``gate_up_proj``) is ``[gate | up]``; the slice
sizes come from the geometry (:meth:`ArchSpec.fused_sizes`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from symfuse.errors import SymfuseError, UnsupportedArchitecture

ModuleKind = Literal["attn", "ffn"]
ModuleWeights = dict[str, torch.Tensor]

ATTN_ROLES = ("q", "k", "v", "o", "pos_q", "pos_k", "q_norm", "k_norm")
FFN_ROLES = ("up", "gate", "down")
FUSED = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}  # fused role -> canonical roles, in row order


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
    qk_norm: bool = False  # Qwen3: per-head RMSNorm (learned weight) on q and k; QK maps are not exact

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
    q_norm: str | None = None  # per-head RMSNorm on queries (Qwen3)
    k_norm: str | None = None


@dataclass(frozen=True)
class FFNSpec:
    """Where the FFN projections live; ``gate`` only for gated MLPs, ``gate_up`` when both are fused."""

    down: str
    up: str | None = None
    gate: str | None = None
    gate_up: str | None = None  # fused [gate | up] (Phi-3 gate_up_proj)
    activation_key: str = "hidden_act"

    def __post_init__(self) -> None:
        if (self.up is None) == (self.gate_up is None):
            raise ValueError("ffn: give exactly one of `up` and `gate_up`")


@dataclass(frozen=True)
class NormSpec:
    """The two per-layer norms; ``placement`` is ``pre`` (before the sublayer) or ``post``.

    ``extra``: further per-layer norms acting on d_model vectors (Gemma-2's norms on each sublayer's output);
    a residual permutation permutes them too.
    """

    kind: Literal["layernorm", "rmsnorm"]
    placement: Literal["pre", "post"]
    attn: str
    ffn: str
    extra: tuple[str, ...] = ()


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
        embedding_projection: Linear from the embedding size to d_model (ELECTRA ``embeddings_project``); when a
            checkpoint has it, the embeddings and their norm live before it, outside the residual stream.
        final_norm: Final norm (pre-LN models), if any.
        rope: Rotary position embeddings on Q/K (rotate_half pairing of i and i + d/2).
        conv1d: Weights stored as (in, out) (GPT-2 ``Conv1D``).
        relative_embeddings: DeBERTa relative position embedding table, if any.
        relative_norm: Norm applied to the relative embeddings, if any.
        heads: Pooler / task-head / LM-head tensors touching the residual stream (see :class:`HeadSpec`).
        checkpoint_variants: The same family under the names ``save_pretrained`` writes, where those differ from
            the in-memory module names (``checkpoint_layout`` in the YAML); readers pick the one that matches.
        n_layers_key: Config attribute giving the number of STORED layers (``num_hidden_layers``; ALBERT:
            ``num_hidden_groups``, one stored layer shared by many applications, so one transform serves all).
        require: Config values the spec assumes (``{inner_group_num: 1}``); others are refused by :meth:`geometry`.
        inputs: What the model reads: ``tokens`` (``input_ids`` + ``attention_mask``, from a tokenizer) or
            ``pixels`` (``pixel_values`` of ``config.num_channels`` x ``config.image_size``², e.g. ViT).
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
    embedding_projection: str | None = None
    final_norm: str | None = None
    rope: bool = False
    conv1d: bool = False
    relative_embeddings: str | None = None
    relative_norm: str | None = None
    heads: tuple[HeadSpec, ...] = ()
    checkpoint_variants: tuple[ArchSpec, ...] = ()
    extra: Mapping[str, Any] = field(default_factory=dict)
    inputs: Literal["tokens", "pixels"] = "tokens"
    n_layers_key: str = "num_hidden_layers"
    require: Mapping[str, Any] = field(default_factory=dict)

    def random_inputs(
        self, config: Any, batch: int = 2, seq: int = 12, generator: torch.Generator | None = None
    ) -> dict[str, torch.Tensor]:
        """Random inputs of the kind the family reads (see :attr:`inputs`), for function checks and statistics.

        Tokens: ids in ``[min(5, vocab - 1), vocab)`` with the last 3 positions of row 0 padded out by the mask.
        Pixels: standard normal ``pixel_values`` (batch, channels, size, size).
        """
        g = generator if generator is not None else torch.Generator().manual_seed(0)
        if self.inputs == "pixels":
            size = int(config.image_size)
            return {"pixel_values": torch.randn(batch, int(config.num_channels), size, size, generator=g)}
        vocab = int(config.vocab_size)
        ids = torch.randint(min(5, vocab - 1), vocab, (batch, seq), generator=g)
        mask = torch.ones_like(ids)
        mask[0, -min(3, seq - 1) :] = 0
        return {"input_ids": ids, "attention_mask": mask}

    # ----------------------------------------------------------------- shapes
    def geometry(self, config: Any) -> Geometry:
        """Read the model's shapes from an HF config.

        Args:
            config: A ``transformers.PretrainedConfig`` (or anything with the same attributes).

        Returns:
            The model's :class:`Geometry`.

        Raises:
            UnsupportedArchitecture: partial rotary embeddings (the RoPE-commuting maps assume full rotary).
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
        rope_params = getattr(config, "rope_parameters", None) or {}
        partial = rope_params.get("partial_rotary_factor") if isinstance(rope_params, dict) else None
        partial = partial if partial is not None else getattr(config, "partial_rotary_factor", None)
        for key, want in self.require.items():
            if getattr(config, key, want) != want:
                raise UnsupportedArchitecture(
                    f"{self.family}: {key}={getattr(config, key)!r} is not supported (only {key}={want!r})"
                )
        if self.rope and partial is not None and float(partial) != 1.0:
            raise UnsupportedArchitecture(
                f"{self.family}: partial_rotary_factor={partial} is not supported (only full rotary embeddings); "
                "use a checkpoint with partial_rotary_factor 1.0"
            )
        return Geometry(
            n_layers=int(getattr(config, self.n_layers_key)),
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=n_kv,
            head_dim=head_dim,
            d_ffn=int(d_ffn),
            rope=self.rope,
            gated=self.ffn.gate is not None or self.ffn.gate_up is not None,
            share_att_key=share,
            pos_proj=self.attention.pos_q is not None and relative and not share,
            qk_norm=self.attention.q_norm is not None,
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
        """HF module paths (without ``.weight``) of one module, by role (fused roles of :data:`FUSED` as such)."""
        geo = self.geometry(config)
        base = prefix + self.layer.format(i=ref.layer)
        if ref.kind == "attn":
            a = self.attention
            roles = {"q": a.q, "k": a.k, "v": a.v, "qkv": a.qkv, "o": a.o, "q_norm": a.q_norm, "k_norm": a.k_norm}
            if geo.pos_proj:
                roles.update(pos_q=a.pos_q, pos_k=a.pos_k)
        else:
            f = self.ffn
            roles = {"up": f.up, "gate": f.gate, "gate_up": f.gate_up, "down": f.down}
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

    def stream_norm_paths(self, layer: int, prefix: str = "") -> list[str]:
        """Module paths of EVERY per-layer norm on d_model vectors: :meth:`norm_paths` plus ``norm.extra``."""
        base = prefix + self.layer.format(i=layer)
        return [*self.norm_paths(layer, prefix).values(), *(self._join(base, p) for p in self.norm.extra)]

    def fused_sizes(self, fused: str, geo: Geometry) -> list[int]:
        """Row counts of the canonical roles inside a fused tensor (see :data:`FUSED`), in order."""
        q_out, kv_out = geo.n_heads * geo.head_dim, geo.n_kv_heads * geo.head_dim
        return {"qkv": [q_out, kv_out, kv_out], "gate_up": [geo.d_ffn, geo.d_ffn]}[fused]

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
            if self.conv1d and not is_bias and t.dim() == 2:
                t = t.t()  # Conv1D stores (in, out)
            fused = role.removesuffix("_bias")
            if fused in FUSED:
                suffix = role[len(fused) :]
                parts = torch.split(t, self.fused_sizes(fused, geo), dim=0)
                for r, part in zip(FUSED[fused], parts, strict=True):
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
        for fused, roles in FUSED.items():
            if fused not in names:
                continue
            for suffix in ("", "_bias"):
                parts = [w.pop(r + suffix, None) for r in roles]
                if all(p is not None for p in parts):
                    w[fused + suffix] = torch.cat(parts, dim=0)
        out = {}
        for role, t in w.items():
            if self.conv1d and not role.endswith("_bias") and t.dim() == 2:
                t = t.t()
            out[names[role]] = t.contiguous()
        return out

    @staticmethod
    def _join(*parts: str) -> str:
        return ".".join(p for p in parts if p)
