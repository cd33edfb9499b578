"""Value types of the architecture specs: module references, shapes, and where tensors live in a layer.

:class:`symfuse.arch.spec.ArchSpec` combines them; families are data (``families/*.yaml``).

Stacks. A model is one or more *stacks* of layers (:class:`StackSpec`): encoder-only and decoder-only families have
one, unnamed; T5 has an encoder stack, a decoder self-attention + FFN stack and a decoder cross-attention stack
(``enc`` / ``dec`` / ``cross``); CLIP a text and a vision tower. Each stack has its own layer template, module
locations, per-layer norms and shapes (CLIP's towers read theirs from ``text_config`` / ``vision_config``), and
writes one *residual stream*: stacks naming the same ``stream`` share one (T5: the shared embedding ties encoder
and decoder), so a residual-stream change of basis acts on all of them alike. Module keys carry the stack name
(``enc.L03.attn``); single-stack families keep the plain ``L03.attn``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

ModuleKind = Literal["attn", "ffn"]


@dataclass(frozen=True, order=True)
class ModuleRef:
    """One attention or FFN module of one layer of one stack; ``key`` names tasks and artifacts (``L07.attn``).

    In a named stack the key starts with the stack (``enc.L07.attn``). Refs sort by stack, then layer, then kind.
    """

    stack: str = field(default="", kw_only=True)  # "" for single-stack families
    layer: int
    kind: ModuleKind

    @property
    def key(self) -> str:
        """Stable short name, e.g. ``L07.attn`` or ``dec.L07.ffn``."""
        return f"{self.stack + '.' if self.stack else ''}L{self.layer:02d}.{self.kind}"

    @classmethod
    def parse(cls, key: str) -> ModuleRef:
        """Inverse of :attr:`key`.

        Raises:
            ValueError: if ``key`` is not of the form ``[<stack>.]L<int>.<attn|ffn>``.
        """
        parts = key.split(".")
        stack = parts[0] if len(parts) == 3 and parts[0].isidentifier() else ""
        layer, kind = (parts[-2], parts[-1]) if len(parts) in (2, 3) else ("", "")
        bad_stack = len(parts) == 3 and not stack
        if bad_stack or not layer.startswith("L") or not layer[1:].isdigit() or kind not in ("attn", "ffn"):
            raise ValueError(f"not a module key: {key!r} (expected e.g. 'L07.attn', 'L07.ffn' or 'enc.L07.attn')")
        return cls(int(layer[1:]), kind, stack=stack)  # type: ignore[arg-type]


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
    shared_head_bias: bool = False  # T5: a per-head score bias computed once and reused by every layer
    stacks: tuple[tuple[str, Geometry], ...] = ()  # per-stack shapes of a multi-stack family (see module doc)

    @property
    def group_size(self) -> int:
        """Query heads per KV head (1 without GQA)."""
        return self.n_heads // self.n_kv_heads

    def of(self, stack: str) -> Geometry:
        """The shapes of one stack (``ModuleRef.stack``); a single-stack geometry is its own.

        Raises:
            KeyError: a stack this model does not have.
        """
        return dict(self.stacks)[stack] if self.stacks else self


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
    head_table: str | None = None  # T5 relative_attention_bias: (buckets, n_heads) per-head score biases


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
    attn: str | None = None
    ffn: str | None = None
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
class StackSpec:
    """One stack of layers (see the module docstring); single-stack families have one, named ``""``.

    Attributes:
        name: Stack name in module keys (``enc``); ``""`` for the only stack of a single-stack family.
        layer: Template of a layer's prefix, e.g. ``encoder.block.{i}``.
        norm: Per-layer norm locations (a stack without FFN has no ``ffn`` norm).
        attention: Attention tensor locations (None: the stack has no attention module).
        ffn: FFN tensor locations (None: the stack has no FFN module, e.g. T5's cross-attention stack).
        n_layers_key: Config attribute giving the number of stored layers.
        config: Attribute of the model config holding this stack's shapes (CLIP ``text_config``); None: the
            model config itself.
        stream: The residual stream the stack reads and writes; stacks with one name share one stream.
        embeddings: Embedding modules / parameters writing this stream (besides the family's top-level ones).
        embedding_norm: Norm applied to this stream's embeddings (CLIP vision ``pre_layrnorm``), if any.
        final_norm: Final norm of this stack, if any.
        heads: Tensors outside the layers reading this stream (see :class:`HeadSpec`).
    """

    name: str
    layer: str
    norm: NormSpec
    attention: AttentionSpec | None = None
    ffn: FFNSpec | None = None
    n_layers_key: str = "num_hidden_layers"
    config: str | None = None
    stream: str = ""
    embeddings: tuple[str, ...] = ()
    embedding_norm: str | None = None
    final_norm: str | None = None
    heads: tuple[HeadSpec, ...] = ()

    def kinds(self) -> tuple[ModuleKind, ...]:
        """The module kinds of each layer of this stack, in forward order."""
        out: tuple[ModuleKind, ...] = ("attn",) if self.attention is not None else ()
        return (*out, "ffn") if self.ffn is not None else out
