"""Soft alignment maps from optimal transport (OT fusion): NOT symmetries, so NOT function-preserving.

A transport plan ``T`` (n_source, n_anchor) with uniform marginals (rows sum to ``1/n_source``, columns to
``1/n_anchor``) becomes the *alignment map* ``M = n_anchor · T``: every column of ``M`` sums to 1, so anchor unit
``j`` of the aligned source is the ``M[:, j]``-weighted average of source units (Singh & Jaggi 2020, Imfeld et al.
2024). Output axes (rows) become ``M^T W``, input axes (columns) ``W M``. When ``T`` is a permutation matrix / n,
``M`` is the permutation matrix itself (``M[perm[j], j] = 1``) and these maps equal the exact permutations of
:mod:`symfuse.symmetry.transforms` / :mod:`symfuse.symmetry.residual`; the OT matcher then emits those exact
parts instead. A genuinely soft ``M`` averages units: the aligned source computes a DIFFERENT function (the
nonlinearities do not commute with the averaging), it has no inverse, and statistics cannot follow it (they are
recollected: the part names are in the ``ot`` kinds of ``symfuse.symmetry.registry``, declared ``gram=False``).

* :class:`FFNTransport` ``map`` (d_ffn, d_ffn): rows of up / gate (+ biases) ``M^T W``, columns of down ``W M``.
* :class:`HeadTransport` ``map`` (n_kv, n_kv) over KV groups (query heads move with their group, each head a
  block of ``head_dim`` rows): ``q' / k' / v' / pos_*`` group ``j`` = ``sum_i M[i, j]`` group ``i``; the same for
  the head columns of ``o``.
* :class:`ResidualTransport` ``map`` (d_model, d_model): the residual stream; use :func:`transport_residual` for a
  whole model (embeddings, every norm, modules, heads on top), like :func:`symfuse.symmetry.residual.permute_residual`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from typing_extensions import override

from symfuse.arch.spec import ArchSpec
from symfuse.errors import UnsupportedArchitecture
from symfuse.symmetry.residual import residual_plan
from symfuse.symmetry.transforms import Transform, Weights, register_transform

SOFT_PARTS = ("ffn_transport", "head_transport", "resid_transport")
_READ_ROLES = ("q", "k", "v", "pos_q", "pos_k", "up", "gate")
_WRITE_ROLES = ("o", "down")


def _wd(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype in (torch.float32, torch.float64) else torch.float32


def rows(w: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``M^T w`` along the first axis (new row ``j`` = ``sum_i M[i, j] w[i]``), in ``w``'s dtype."""
    wd = _wd(w)
    return torch.tensordot(m.to(wd).T, w.to(wd), dims=1).to(w.dtype)


def cols(w: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``w M`` along the last axis, in ``w``'s dtype."""
    wd = _wd(w)
    return (w.to(wd) @ m.to(wd)).to(w.dtype)


@dataclass(frozen=True, eq=False)
class _Soft(Transform):
    map: torch.Tensor  # (n_source, n_anchor) float64, columns sum to 1

    @override
    def inverse(self) -> Transform:
        raise ValueError(f"{self.name}: a soft transport map averages units and has no exact inverse")

    @override
    def tensors(self) -> dict[str, torch.Tensor]:
        return {"map": self.map}


@register_transform
@dataclass(frozen=True, eq=False)
class FFNTransport(_Soft):
    """Soft neuron alignment: up / gate rows (+ biases) ``M^T W``, down columns ``W M`` (see module docstring)."""

    name: ClassVar[str] = "ffn_transport"

    @override
    def apply(self, weights: Mapping[str, torch.Tensor]) -> Weights:
        out = dict(weights)
        for r in ("up", "up_bias", "gate", "gate_bias"):
            if r in weights:
                out[r] = rows(weights[r], self.map)
        out["down"] = cols(weights["down"], self.map)
        return out

    @override
    def apply_to_gram(self, role: str, gram: torch.Tensor) -> torch.Tensor:
        """``M^T G M`` for the input of ``down`` (the linear change of its input; the model itself changed)."""
        if role != "down":
            return gram
        return cols(rows(gram, self.map), self.map)


@register_transform
@dataclass(frozen=True, eq=False)
class HeadTransport(_Soft):
    """Soft KV-group alignment (query heads move with their group; heads are ``head_dim`` blocks)."""

    name: ClassVar[str] = "head_transport"

    @override
    def apply(self, weights: Mapping[str, torch.Tensor]) -> Weights:
        out = dict(weights)
        n_kv = self.map.shape[0]
        dh = weights["k"].shape[0] // n_kv
        for r in ("q", "q_bias", "pos_q", "pos_q_bias", "k", "k_bias", "v", "v_bias", "pos_k", "pos_k_bias"):
            if r in weights:
                w = weights[r]
                g = w.reshape(n_kv, -1)  # group i's rows (its query heads' blocks, or its k/v block), flattened
                out[r] = rows(g, self.map).reshape(w.shape)
        o = weights["o"]
        n_heads = o.shape[1] // dh
        g = o.reshape(o.shape[0], n_kv, (n_heads // n_kv) * dh).transpose(1, 2)  # (d, G*dh, n_kv)
        out["o"] = cols(g, self.map).transpose(1, 2).reshape(o.shape).contiguous()
        return out


@register_transform
@dataclass(frozen=True, eq=False)
class ResidualTransport(_Soft):
    """Soft residual-stream map on ONE module: read-role columns ``W M``, write-role rows (+ biases) ``M^T W``."""

    name: ClassVar[str] = "resid_transport"

    @override
    def apply(self, weights: Mapping[str, torch.Tensor]) -> Weights:
        out = dict(weights)
        for r in _READ_ROLES:
            if r in weights:
                out[r] = cols(weights[r], self.map)
        for r in _WRITE_ROLES:
            for rr in (r, r + "_bias"):
                if rr in weights:
                    out[rr] = rows(weights[rr], self.map)
        return out


def _move(t: torch.Tensor, action: str, m: torch.Tensor) -> torch.Tensor:
    if action == "emb":  # embedding table (n, d) or ViT patch convolution (d, c, h, w)
        action = "first" if t.ndim == 4 else "last"
    if action in ("last", "cols"):
        return cols(t, m).contiguous()
    if action == "first":
        return rows(t, m).contiguous()
    return cols(rows(t, m), m).contiguous()  # both


def transport_residual(
    state: Mapping[str, torch.Tensor], spec: ArchSpec, config: Any, m: torch.Tensor, prefix: str | None = None
) -> dict[str, torch.Tensor]:
    """Apply one soft residual-stream map ``M`` (d_model, d_model) to a whole model's tensors (NOT exact).

    The same tensors as :func:`symfuse.symmetry.residual.permute_residual` move, with the permutation replaced by
    ``M``: stream axes of embeddings, norms, modules and heads. A permutation matrix gives exactly
    ``permute_residual``'s result.

    Args:
        state: ``{stored name: tensor}`` of the whole model.
        spec: The family spec.
        config: HF config.
        m: (d_model, d_model) alignment map (columns sum to 1).
        prefix: Base-model prefix; detected from the names when None.

    Returns:
        A NEW dict with every tensor (untouched ones by reference).

    Raises:
        UnsupportedArchitecture: a floating tensor with a d_model-sized axis has no rule (see ``permute_residual``).
    """
    geo = spec.geometry(config)
    if tuple(m.shape) != (geo.d_model, geo.d_model):
        raise ValueError(f"residual map must be ({geo.d_model}, {geo.d_model}), got {tuple(m.shape)}")
    prefix = spec.detect_prefix(state) if prefix is None else prefix
    out = dict(state)
    t = ResidualTransport(m)
    touched: set[str] = set()
    for ref in spec.modules(config):
        w = spec.read_module(state.__getitem__, state.__contains__, ref, config, prefix)
        new = spec.write_module(t.apply(w), ref, config, prefix)
        out.update(new)
        touched |= set(new)
    for name, action in residual_plan(spec, list(state), config, prefix).items():
        out[name] = _move(state[name], action, m)
        touched.add(name)
    stray = [
        n
        for n, v in state.items()
        if n not in touched
        and v.is_floating_point()
        and geo.d_model in tuple(v.shape)
        and not n.endswith(("inv_freq", "position_ids", "token_type_ids"))
    ]
    if stray:
        raise UnsupportedArchitecture(
            f"{spec.family}: tensors {stray[:5]} have a d_model-sized axis but no residual rule; "
            f"add their module to `heads` in arch/families/{spec.family}.yaml"
        )
    return out
