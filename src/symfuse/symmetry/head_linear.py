"""The ``head-linear`` kind: an invertible map per KV group on the QK and on the OV side of attention.

The per-head symmetry group of attention is GL(dh) on each side (conventions of :mod:`symfuse.symmetry.transforms`:
rows of ``q`` / ``k`` / ``v``, columns of ``o``; ``M`` (n_kv, dh, dh) per KV group, shared by its query heads):

* :class:`QKLinear`: ``q_h' = M_g q_h``, ``k_g' = M_g^{-T} k_g`` (biases, DeBERTa's ``pos_q`` / ``pos_k`` likewise),
  so every score ``q^T k`` (and ``q^T pos_k``, ``pos_q^T k``) is unchanged for ANY invertible ``M_g``. In the
  column convention ``W_Q^h -> W_Q^h A``, ``W_K -> W_K A^{-T}`` with ``A = M^T``.
* :class:`VOLinear`: ``v_g' = M_g v_g``, ``o_h' = o_h M_g^{-1}``: each head's output ``O_h V_g x`` is unchanged.

Where it is exact (``SymmetryKind.restricted_by`` and the draw / finder leave the rest out):

* RoPE (llama, qwen3, gemma, phi3: ``Geometry.rope``): the QK map must commute with every RoPE rotation, i.e. be a
  complex scalar per frequency pair ``(i, i + dh/2)``: the 2x2 block ``[[a, -b], [b, a]]`` (a scaled rotation;
  reflections do not commute). That subgroup is exactly RoPE's pair rotations times pair scales (the
  ``rotation`` and ``scaling`` kinds under RoPE). The VO map is unrestricted.
* Per-head q/k norms (``Geometry.qk_norm``, Qwen3): no QK map is exact; only the VO map is drawn and matched.
* Pre-LN or post-LN, a per-head score bias shared by the layers (T5's table): the maps act inside the heads, the
  bias is not touched (a head permutation is restricted there, not these maps).

Statistics: the Gram of o_proj's input follows :class:`VOLinear` exactly (head block ``x_h' = M_g x_h``:
``T G T^T``); q / k / v read the residual stream (unchanged). A diagonal Fisher does not follow a dense map: it is
recollected.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch
from typing_extensions import override

from symfuse.arch import Geometry, ModuleRef
from symfuse.symmetry.random import random_orthogonal, rope_rotation
from symfuse.symmetry.transforms import Transform, Weights, head_block_gram, map_qk, map_vo, register_transform

MAX_LOG_SINGULAR = math.log(3.0)  # drawn singular values lie in [1/3, 3]


@dataclass(frozen=True, eq=False)
class _GroupLinear(Transform):
    """An invertible map per KV group; subclasses say which roles it multiplies."""

    mat: torch.Tensor  # (n_kv, dh, dh) float64, invertible

    def _inv_t(self) -> torch.Tensor:
        """``M^{-T}`` per group, float64 (what the other side of the circuit gets)."""
        return torch.linalg.inv(self.mat.to(torch.float64)).mT

    @override
    def inverse(self) -> _GroupLinear:
        return type(self)(torch.linalg.inv(self.mat.to(torch.float64)).contiguous())

    @override
    def tensors(self) -> dict[str, torch.Tensor]:
        return {"mat": self.mat}

    @override
    def merge(self, earlier: Transform) -> Transform | None:
        same = type(earlier) is type(self)
        return type(self)(self.mat @ earlier.mat) if same else None  # type: ignore[attr-defined]

    @override
    def condition(self) -> float:
        return float(torch.linalg.cond(self.mat.to(torch.float64)).max())


@register_transform
@dataclass(frozen=True, eq=False)
class QKLinear(_GroupLinear):
    """Per-KV-group invertible map on queries and keys: ``q_h' = M_g q_h``, ``k_g' = M_g^{-T} k_g``."""

    name: ClassVar[str] = "qk_linear"

    @override
    def apply(self, weights: Mapping[str, torch.Tensor]) -> Weights:
        return map_qk(weights, self.mat, self._inv_t())


@register_transform
@dataclass(frozen=True, eq=False)
class VOLinear(_GroupLinear):
    """Per-KV-group invertible map on values and output: ``v_g' = M_g v_g``, ``o_h' = o_h M_g^{-1}``."""

    name: ClassVar[str] = "vo_linear"

    @override
    def apply(self, weights: Mapping[str, torch.Tensor]) -> Weights:
        return map_vo(weights, self.mat, self._inv_t())  # o_h' = o_h M^{-1}: (o_h')^T = M^{-T} o_h^T

    @override
    def apply_to_gram(self, role: str, gram: torch.Tensor) -> torch.Tensor:
        return head_block_gram(self.mat, gram) if role == "o" else gram


# ------------------------------------------------------------------------------------------------ draws
def _singular_values(shape: tuple[int, ...], g: torch.Generator, log_scale: float) -> torch.Tensor:
    """Log-normal values ``exp(2 log_scale z)`` clipped to ``[1/3, 3]`` (float64)."""
    z = torch.randn(*shape, generator=g, dtype=torch.float64) * (2 * log_scale)
    return z.clamp(-MAX_LOG_SINGULAR, MAX_LOG_SINGULAR).exp()


def random_linear(dh: int, n: int, g: torch.Generator, log_scale: float) -> torch.Tensor:
    """Well-conditioned random invertible maps ``U diag(s) V^T`` (Haar ``U``, ``V``; ``s`` in [1/3, 3]).

    Returns:
        (n, dh, dh) float64, condition number at most 9.
    """
    u, v = random_orthogonal(dh, n, g), random_orthogonal(dh, n, g)
    return u * _singular_values((n, 1, dh), g, log_scale) @ v.mT


def random_rope_linear(dh: int, n: int, g: torch.Generator, log_scale: float) -> torch.Tensor:
    """Random maps commuting with RoPE: per frequency pair ``(i, i + dh/2)`` a scaled rotation ``[[a, -b], [b, a]]``.

    Returns:
        (n, dh, dh) float64: angle uniform in (-pi, pi], modulus in [1/3, 3].
    """
    angle = (torch.rand(n, dh // 2, generator=g, dtype=torch.float64) * 2 - 1) * math.pi
    modulus = _singular_values((n, dh // 2), g, log_scale).repeat(1, 2)  # the same on both rows of a pair
    return modulus[:, :, None] * rope_rotation(angle)


def draw_head_linear(ref: ModuleRef, geo: Geometry, g: torch.Generator, log_scale: float) -> tuple[Transform, ...]:
    """Random QK (RoPE-commuting under RoPE; none with per-head q/k norms) and VO invertible maps per KV group.

    Args:
        ref: The attention module (unused: every layer draws alike).
        geo: Its stack's geometry.
        g: Random source (consumed: QK map, then VO map).
        log_scale: Spread of the log singular values (``2 log_scale`` standard deviation, clipped to ``±log 3``).
    """
    n, dh = geo.n_kv_heads, geo.head_dim
    parts: list[Transform] = []
    if not geo.qk_norm:
        draw = random_rope_linear if geo.rope else random_linear
        parts.append(QKLinear(draw(dh, n, g, log_scale)))
    parts.append(VOLinear(random_linear(dh, n, g, log_scale)))
    return tuple(parts)
