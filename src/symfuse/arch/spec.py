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
        head_table: (buckets, n_heads)           T5 relative-position score bias, one column per head (as stored)
    ffn:       up gate down                (+ "<role>_bias")
        up / gate: (d_ffn, d_model)              down: (d_model, d_ffn)

Fused tensors are ROW slices of one stored tensor, named once in :data:`FUSED`: ``qkv`` (GPT-2 ``c_attn``,
Phi-3 ``qkv_proj``) is ``[q | k | v]``, ``gate_up`` (Phi-3 ``gate_up_proj``) is ``[gate | up]``; the slice
sizes come from the geometry (:meth:`ArchSpec.fused_sizes`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from symfuse.arch.layout import (
    AttentionSpec,
    FFNSpec,
    Geometry,
    HeadSpec,
    ModuleKind,
    ModuleRef,
    NormSpec,
    StackSpec,
)
from symfuse.errors import SymfuseError, UnsupportedArchitecture

__all__ = [
    "ATTN_ROLES",
    "FFN_ROLES",
    "FUSED",
    "ArchSpec",
    "AttentionSpec",
    "FFNSpec",
    "Geometry",
    "HeadSpec",
    "ModuleKind",
    "ModuleRef",
    "ModuleWeights",
    "NormSpec",
    "StackSpec",
]

ModuleWeights = dict[str, torch.Tensor]

ATTN_ROLES = ("q", "k", "v", "o", "pos_q", "pos_k", "q_norm", "k_norm", "head_table")
FFN_ROLES = ("up", "gate", "down")
FUSED = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}  # fused role -> canonical roles, in row order
# geometry field -> config attributes read for it, first present wins (``config_keys`` in the YAML overrides)
GEOMETRY_KEYS = {
    "d_model": ("hidden_size",),
    "n_heads": ("num_attention_heads",),
    "n_kv_heads": ("num_key_value_heads",),
    "head_dim": ("head_dim",),
    "d_ffn": ("intermediate_size", "hidden_dim", "n_inner"),
}
NORM_EPS_KEYS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon")  # config attributes of the norms' epsilon


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
        inputs: What the model reads, one or more of ``tokens`` (``input_ids`` + ``attention_mask``, from a
            tokenizer), ``pixels`` (``pixel_values`` of ``num_channels`` x ``image_size``², e.g. ViT) and
            ``decoder_tokens`` (``decoder_input_ids`` of an encoder-decoder, T5); CLIP reads tokens and pixels.
        stacks: The stacks of a multi-stack family (T5, CLIP; see :mod:`symfuse.arch.layout`); empty for the
            others, whose one stack is the top-level ``layer`` / ``attention`` / ``ffn`` / ``norm``
            (:meth:`all_stacks`). With stacks, those top-level fields are the first stack's.
        config_keys: Config attribute names for the geometry where the defaults do not apply
            (``{d_ffn: d_ff}`` for T5); keys ``d_model``, ``n_heads``, ``n_kv_heads``, ``head_dim``, ``d_ffn``.
        output: The model output function checks compare when it is not ``logits`` (CLIP ``logits_per_image``).
        forward: How :mod:`symfuse.match.forward` runs the base model without transformers' modelling code
            (``forward`` in the YAML: ``embeddings`` roles, ``position_ids``, ``causal``, ``eps``); ``None``: the
            output check builds the transformers model.
        residual_group: The largest group of maps of the residual stream that is exact in the family's own
            architecture once its norms' gains (and LayerNorm biases) are folded into the layers that read them:
            ``orthogonal`` (pre-RMSNorm: any orthogonal map), ``orthogonal-fixing-ones`` (pre-LayerNorm: orthogonal
            maps with ``O 1 = 1``, so that mean-centring commutes), ``permutation`` (post-LN families, and those whose
            norms cannot be folded: Gemma's ``1 + w`` gains, Gemma-2's extra sublayer norms, multi-stack families
            for now). See :mod:`symfuse.symmetry.residual_orthogonal`.
        config_variants: ``(when, spec)`` pairs: the family as stored when the config has the values ``when``
            (``config_variants`` in the YAML; T5 v1.1 / mT5 gated FFN); :func:`symfuse.arch.get_spec` picks it.
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
    config_variants: tuple[tuple[Mapping[str, Any], ArchSpec], ...] = ()
    extra: Mapping[str, Any] = field(default_factory=dict)
    inputs: tuple[str, ...] = ("tokens",)
    n_layers_key: str = "num_hidden_layers"
    require: Mapping[str, Any] = field(default_factory=dict)
    stacks: tuple[StackSpec, ...] = ()
    config_keys: Mapping[str, str] = field(default_factory=dict)
    output: str | None = None
    forward: Mapping[str, Any] | None = None
    residual_group: str = "permutation"

    def all_stacks(self) -> tuple[StackSpec, ...]:
        """:attr:`stacks`, or the one unnamed stack of a single-stack family (its top-level fields)."""
        if self.stacks:
            return self.stacks
        return (StackSpec("", self.layer, self.norm, self.attention, self.ffn, self.n_layers_key),)

    def stack(self, name: str) -> StackSpec:
        """One stack by name (``ModuleRef.stack``).

        Raises:
            KeyError: the family has no such stack.
        """
        for st in self.all_stacks():
            if st.name == name:
                return st
        raise KeyError(f"{self.family} has no stack {name!r}")

    def streams(self, config: Any) -> dict[str, int]:
        """Every residual stream with its width, ``{stream name: d_model}`` (``{"": d}`` for one stream)."""
        geo = self.geometry(config)
        return {st.stream: geo.of(st.name).d_model for st in self.all_stacks()}

    def _setting(self, config: Any, name: str) -> Any:
        """A config value read from the config or, failing that, from the first stack sub-config holding it."""
        if hasattr(config, name):
            return getattr(config, name)
        for st in self.all_stacks():
            sub = getattr(config, st.config, None) if st.config else None
            if sub is not None and hasattr(sub, name):
                return getattr(sub, name)
        raise AttributeError(f"{self.family} config has no {name!r}")

    def random_inputs(
        self, config: Any, batch: int = 2, seq: int = 12, generator: torch.Generator | None = None
    ) -> dict[str, torch.Tensor]:
        """Random inputs of the kinds the family reads (see :attr:`inputs`), for function checks and statistics.

        Tokens: ids in ``[min(5, vocab - 1), vocab)`` with the last 3 positions of row 0 padded out by the mask.
        Decoder tokens (encoder-decoder families): ``decoder_input_ids`` drawn alike (``seq - 2`` positions).
        Pixels: standard normal ``pixel_values`` (batch, channels, size, size).
        """
        g = generator if generator is not None else torch.Generator().manual_seed(0)
        out: dict[str, torch.Tensor] = {}
        if "pixels" in self.inputs:
            size, ch = int(self._setting(config, "image_size")), int(self._setting(config, "num_channels"))
            out["pixel_values"] = torch.randn(batch, ch, size, size, generator=g)
        vocab = int(self._setting(config, "vocab_size")) if {"tokens", "decoder_tokens"} & set(self.inputs) else 0
        if "tokens" in self.inputs:
            ids = torch.randint(min(5, vocab - 1), vocab, (batch, seq), generator=g)
            mask = torch.ones_like(ids)
            mask[0, -min(3, seq - 1) :] = 0
            out.update(input_ids=ids, attention_mask=mask)
        if "decoder_tokens" in self.inputs:
            out["decoder_input_ids"] = torch.randint(min(5, vocab - 1), vocab, (batch, max(1, seq - 2)), generator=g)
        return out

    def main_output(self, output: Any) -> torch.Tensor:
        """The output tensor that function checks compare.

        :attr:`output` (CLIP ``logits_per_image``) when the model returns it, else ``logits``, else
        ``last_hidden_state``.
        """
        for key in (self.output, "logits", "last_hidden_state"):
            value = getattr(output, key, None) if key else None
            if value is not None:
                return value
        raise ValueError(f"{self.family}: the model output has none of {self.output}, logits, last_hidden_state")

    # ----------------------------------------------------------------- shapes
    def geometry(self, config: Any) -> Geometry:
        """Read the model's shapes from an HF config.

        Args:
            config: A ``transformers.PretrainedConfig`` (or anything with the same attributes).

        Returns:
            The model's :class:`Geometry`: the first stack's shapes, with every stack's in ``stacks`` when the
            family has several (:meth:`Geometry.of`).

        Raises:
            UnsupportedArchitecture: partial rotary embeddings (the RoPE-commuting maps assume full rotary) or a
                config value outside :attr:`require`.
        """
        for key, want in self.require.items():
            if getattr(config, key, want) != want:
                raise UnsupportedArchitecture(
                    f"{self.family}: {key}={getattr(config, key)!r} is not supported (only {key}={want!r})"
                )
        geos = [(st.name, self._stack_geometry(config, st)) for st in self.all_stacks()]
        return geos[0][1] if len(geos) == 1 else replace(geos[0][1], stacks=tuple(geos))

    def geometry_keys(self, name: str) -> tuple[str, ...]:
        """Config attributes read for one geometry field (``d_model`` ... ``d_ffn``), first present wins."""
        return (self.config_keys[name],) if name in self.config_keys else GEOMETRY_KEYS[name]

    def _stack_geometry(self, config: Any, st: StackSpec) -> Geometry:
        cfg = getattr(config, st.config) if st.config else config

        def read(name: str) -> Any:
            for k in self.geometry_keys(name):
                v = getattr(cfg, k, None)
                if v is not None:
                    return v
            return None

        d_model = int(read("d_model"))
        n_heads = int(read("n_heads"))
        n_kv = int(read("n_kv_heads") or n_heads)
        head_dim = int(read("head_dim") or d_model // n_heads)
        d_ffn = read("d_ffn") or 4 * d_model  # GPT-2: 4 * d
        pos_types = getattr(cfg, "pos_att_type", None) or ()
        relative = bool(getattr(cfg, "relative_attention", False)) and bool(pos_types)
        share = bool(getattr(cfg, "share_att_key", False))
        rope_params = getattr(cfg, "rope_parameters", None) or {}
        partial = rope_params.get("partial_rotary_factor") if isinstance(rope_params, dict) else None
        partial = partial if partial is not None else getattr(cfg, "partial_rotary_factor", None)
        if self.rope and partial is not None and float(partial) != 1.0:
            raise UnsupportedArchitecture(
                f"{self.family}: partial_rotary_factor={partial} is not supported (only full rotary embeddings); "
                "use a checkpoint with partial_rotary_factor 1.0"
            )
        attn, ffn = st.attention, st.ffn
        return Geometry(
            n_layers=int(getattr(cfg, st.n_layers_key)),
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=n_kv,
            head_dim=head_dim,
            d_ffn=int(d_ffn),
            rope=self.rope,
            gated=ffn is not None and (ffn.gate is not None or ffn.gate_up is not None),
            share_att_key=share,
            pos_proj=attn is not None and attn.pos_q is not None and relative and not share,
            qk_norm=attn is not None and attn.q_norm is not None,
            shared_head_bias=attn is not None and attn.head_table is not None,
        )

    def modules(self, config: Any) -> list[ModuleRef]:
        """Every attention and FFN module, stack by stack, in layer order (attention first)."""
        geo = self.geometry(config)
        return [
            ModuleRef(i, kind, stack=st.name)
            for st in self.all_stacks()
            for i in range(geo.of(st.name).n_layers)
            for kind in st.kinds()
        ]

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
        st = self.stack(ref.stack)
        geo = self.geometry(config).of(ref.stack)
        base = prefix + st.layer.format(i=ref.layer)
        if ref.kind == "attn" and st.attention is not None:
            a = st.attention
            roles = {"q": a.q, "k": a.k, "v": a.v, "qkv": a.qkv, "o": a.o, "q_norm": a.q_norm, "k_norm": a.k_norm}
            roles["head_table"] = a.head_table
            if geo.pos_proj:
                roles.update(pos_q=a.pos_q, pos_k=a.pos_k)
        elif ref.kind == "ffn" and st.ffn is not None:
            f = st.ffn
            roles = {"up": f.up, "gate": f.gate, "gate_up": f.gate_up, "down": f.down}
        else:
            raise KeyError(f"{self.family}: stack {ref.stack!r} has no {ref.kind} module ({ref.key})")
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

    def norm_paths(self, layer: int, prefix: str = "", stack: str = "") -> dict[str, str]:
        """Module paths of one layer's norms, by sublayer (``attn`` / ``ffn``; a stack's sublayers only)."""
        st = self.stack(stack)
        base = prefix + st.layer.format(i=layer)
        subs = {"attn": st.norm.attn, "ffn": st.norm.ffn}
        return {sub: self._join(base, p) for sub, p in subs.items() if p is not None}

    def stream_norm_paths(self, layer: int, prefix: str = "", stack: str = "") -> list[str]:
        """Module paths of EVERY per-layer norm on d_model vectors: :meth:`norm_paths` plus ``norm.extra``."""
        st = self.stack(stack)
        base = prefix + st.layer.format(i=layer)
        return [*self.norm_paths(layer, prefix, stack).values(), *(self._join(base, p) for p in st.norm.extra)]

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
        geo = self.geometry(config).of(ref.stack)
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
