"""The base model's forward pass from the family spec, in plain torch, one layer in memory at a time.

The streamed output check of ``symfuse match`` (:class:`symfuse.match.output_check.StreamedReference`) compares the
matched model with SOURCE on a few random sequences. Building transformers' model for that costs more than the
check itself (importing its modelling code: ~2.3 s and ~140 MiB on roberta-base, before any weight is read), so
families whose YAML has a ``forward`` block run here instead: embeddings, then each layer's attention and FFN read
in canonical layout (:meth:`symfuse.arch.ArchSpec.read_module`) just before they run, then the final norm. The
output is the last hidden state (the residual stream), float32, which every weight-space symmetry of the match
command leaves unchanged (a residual permutation would not: its checks keep transformers' model and the logits).

Supported: post- and pre-norm stacks, LayerNorm and RMSNorm, absolute (learned) positions or RoPE (the default
rotary type), grouped-query attention, per-head Q/K RMSNorm (Qwen3), gated and plain FFNs, causal and
bidirectional attention. :func:`plain_forward_supported` says when a checkpoint qualifies; the rest fall back to
transformers. ``tests/symfuse/match/test_forward.py`` checks the result against transformers' model per family.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from symfuse.arch import ArchSpec, ModuleRef
from symfuse.arch.spec import FUSED, NORM_EPS_KEYS
from symfuse.checkpoint import CheckpointReader
from symfuse.io import BufferPool

__all__ = ["plain_forward", "plain_forward_supported"]

_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}
_LINEAR_ROLES = frozenset(("q", "k", "v", "o", "up", "gate", "down"))


def _rope_theta(config: Any) -> float | None:
    """The default rotary base, or None when the config asks for another rotary type (scaled, partial...)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if params.get("rope_type", params.get("type", "default")) != "default":
        return None
    if float(getattr(config, "partial_rotary_factor", None) or params.get("partial_rotary_factor", 1.0)) != 1.0:
        return None
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    return float(theta) if theta is not None else 10000.0


def plain_forward_supported(spec: ArchSpec, config: Any, seq: int = 12) -> bool:
    """Whether :func:`plain_forward` runs this model (else the check builds transformers' model)."""
    fwd = spec.forward
    if fwd is None or spec.stacks or spec.relative_embeddings or spec.norm.extra:
        return False
    if getattr(config, spec.ffn.activation_key or "", None) not in _ACTIVATIONS:
        return False
    if spec.rope and _rope_theta(config) is None:
        return False
    if getattr(config, "position_embedding_type", None) not in (None, "absolute"):  # BERT relative_key(_query)
        return False
    window = getattr(config, "sliding_window", None)
    if isinstance(window, int) and window < seq and getattr(config, "use_sliding_window", True):
        return False
    return len(fwd.get("embeddings", ())) == len(spec.embeddings)


def _eps(spec: ArchSpec, config: Any) -> float:
    for key in NORM_EPS_KEYS:
        value = getattr(config, key, None)
        if value is not None:
            return float(value)
    return float((spec.forward or {}).get("eps", 1e-12))


def _norm(kind: str, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, eps: float) -> torch.Tensor:
    if kind == "layernorm":
        return F.layer_norm(x, (x.shape[-1],), w, b, eps)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + turned * sin


def _linear(x: torch.Tensor, w: Mapping[str, torch.Tensor], role: str) -> torch.Tensor:
    return F.linear(x, w[role].float(), w[f"{role}_bias"].float() if f"{role}_bias" in w else None)


class _OnRead(Mapping[str, torch.Tensor]):
    """Role -> stored tensor, read (``pread``) at each access into a reused buffer: use it before the next access.

    Matrices share one buffer and biases another (a linear layer reads its matrix, then its bias, then runs), so a
    pass touches new memory for its largest matrix only, not for every layer's (page faults cost as much as reads).
    """

    def __init__(self, names: dict[str, str], get: Callable[[str, str], torch.Tensor]):
        self._names, self._get = names, get

    def __getitem__(self, role: str) -> torch.Tensor:
        slot = "bias" if role.endswith("_bias") else "matrix" if role in _LINEAR_ROLES else role
        return self._get(self._names[role], slot)

    def __contains__(self, role: object) -> bool:  # Mapping's default would read the tensor to find out
        return role in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class _Run:
    """One model's pass: the reader, its spec and config, and the per-pass constants."""

    def __init__(self, reader: CheckpointReader):
        self.r, self.spec, self.config = reader, reader.spec, reader.config
        self.geo = reader.geometry
        self.eps = _eps(self.spec, self.config)
        self.causal = bool((self.spec.forward or {}).get("causal", False))
        self.pool = BufferPool()

    def get(self, name: str, slot: str | None = None) -> torch.Tensor:
        """A stored tensor, ``pread`` into private memory (no file pages mapped); into ``slot`` of the pool if given."""
        return self.r.tensor_file(name).get(name, self.pool if slot else None, slot or "")

    def tensor(self, path: str, suffix: str = "weight") -> torch.Tensor | None:
        name = f"{self.r.prefix}{path}.{suffix}"
        return self.get(name).float() if self.r.has(name) else None

    def rows(self, name: str, index: torch.Tensor) -> torch.Tensor:
        """``table[index]`` reading only the rows used (a vocabulary-sized table is not read whole)."""
        used, inverse = torch.unique(index, return_inverse=True)
        file = self.r.tensor_file(name)
        table = torch.cat([file.get_rows(name, i, i + 1) for i in used.tolist()]).float()
        return table[inverse]

    def module(self, ref: ModuleRef) -> Mapping[str, torch.Tensor]:
        """The module's weights by role; each read when used (one matrix in memory), unless fused or Conv1D."""
        names = self.spec.tensor_names(ref, self.config, self.r.prefix)
        if self.spec.conv1d or any(role.removesuffix("_bias") in FUSED for role in names):
            return self.spec.read_module(self.get, self.r.has, ref, self.config, self.r.prefix)
        return _OnRead({role: n for role, n in names.items() if self.r.has(n)}, self.get)

    def norm(self, path: str, x: torch.Tensor) -> torch.Tensor:
        w = self.tensor(path)
        if w is None:
            raise KeyError(f"{self.r.path}: norm {self.r.prefix}{path}.weight not found")
        return _norm(self.spec.norm.kind, x, w, self.tensor(path, "bias"), self.eps)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        fwd = self.spec.forward or {}
        h = None
        for path, role in zip(self.spec.embeddings, fwd["embeddings"], strict=True):
            name = f"{self.r.prefix}{path}.weight"
            if not self.r.has(name):
                continue
            if role == "word":
                index = ids
            elif role == "token_type":
                index = torch.zeros_like(ids)
            elif fwd.get("position_ids") == "after_padding":  # RoBERTa
                pad = int(self.config.pad_token_id)
                keep = ids.ne(pad).long()
                index = torch.cumsum(keep, dim=1) * keep + pad
            else:
                index = torch.arange(ids.shape[1]).expand_as(ids)
            part = self.rows(name, index)
            h = part if h is None else h + part
        if h is None:
            raise KeyError(f"{self.r.path}: no embedding table of {list(self.spec.embeddings)} is stored")
        if self.spec.embedding_norm:
            h = self.norm(self.spec.embedding_norm, h)
        if self.spec.embedding_projection and self.r.has(f"{self.r.prefix}{self.spec.embedding_projection}.weight"):
            proj = self.spec.embedding_projection
            h = F.linear(h, self.tensor(proj), self.tensor(proj, "bias"))
        return h

    def rope(self, seq: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self.spec.rope:
            return None
        dh = self.geo.head_dim
        theta = _rope_theta(self.config) or 10000.0
        inv = 1.0 / theta ** (torch.arange(0, dh, 2, dtype=torch.int64).float() / dh)
        freqs = torch.outer(torch.arange(seq).float(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def attention(self, w: Mapping[str, torch.Tensor], x: torch.Tensor, mask: torch.Tensor, rope: Any) -> torch.Tensor:
        b, s, _ = x.shape
        nh, nkv, dh = self.geo.n_heads, self.geo.n_kv_heads, self.geo.head_dim
        q = _linear(x, w, "q").view(b, s, nh, dh).transpose(1, 2)
        k = _linear(x, w, "k").view(b, s, nkv, dh).transpose(1, 2)
        v = _linear(x, w, "v").view(b, s, nkv, dh).transpose(1, 2)
        if "q_norm" in w:  # Qwen3: RMSNorm over each head's vector, before RoPE
            q = _norm("rmsnorm", q, w["q_norm"].float(), None, self.eps)
            k = _norm("rmsnorm", k, w["k_norm"].float(), None, self.eps)
        if rope is not None:
            q, k = _rotate(q, *rope), _rotate(k, *rope)
        if nkv != nh:
            k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(dh)
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        out = torch.softmax(scores, dim=-1) @ v
        return _linear(out.transpose(1, 2).reshape(b, s, nh * dh), w, "o")

    def ffn(self, w: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        act = _ACTIVATIONS[getattr(self.config, self.spec.ffn.activation_key)]
        hidden = act(_linear(x, w, "gate")) * _linear(x, w, "up") if "gate" in w else act(_linear(x, w, "up"))
        return _linear(hidden, w, "down")

    def sublayer(self, h: torch.Tensor, ref: ModuleRef, norm: str | None, fn: Any) -> torch.Tensor:
        w = self.module(ref)
        if self.spec.norm.placement == "pre":
            return h + fn(w, self.norm(norm, h) if norm else h)
        out = h + fn(w, h)
        return self.norm(norm, out) if norm else out


def plain_forward(reader: CheckpointReader, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The base model's last hidden state (float32) on ``inputs`` (``input_ids``, ``attention_mask``).

    Each layer's weights are read just before it runs and dropped after; nothing of transformers' modelling code
    is imported. Call only where :func:`plain_forward_supported` holds.

    Args:
        reader: The checkpoint.
        inputs: Token ids and their padding mask, both (batch, seq).

    Returns:
        (batch, seq, d_model) float32.
    """
    run = _Run(reader)
    ids = inputs["input_ids"]
    seq = ids.shape[1]
    keys = inputs.get("attention_mask", torch.ones_like(ids)).bool()[:, None, None, :]
    mask = keys & torch.ones(seq, seq, dtype=torch.bool).tril() if run.causal else keys
    rope = run.rope(seq)
    with torch.no_grad():
        h = run.embed(ids)
        for ref in reader.modules():
            norms = reader.spec.norm_paths(ref.layer)
            if ref.kind == "attn":
                h = run.sublayer(h, ref, norms.get("attn"), lambda w, x: run.attention(w, x, mask, rope))
            else:
                h = run.sublayer(h, ref, norms.get("ffn"), run.ffn)
        if reader.spec.final_norm:
            h = run.norm(reader.spec.final_norm, h)
    return h
