"""Random exact symmetry transforms (used to disguise a model and in tests): the ``draw`` of each built-in kind.

Every draw has the signature ``draw(ref, geo, generator, log_scale) -> tuple[Transform, ...]`` (see
:mod:`symfuse.symmetry.registry`); :func:`random_module_transform` calls the draws of the asked kinds in stage order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from symfuse.arch import Geometry, ModuleRef
from symfuse.symmetry.registry import SYMMETRY_KINDS, check_kinds, compatible_kinds, kinds_for
from symfuse.symmetry.residual import ResidualPermutation
from symfuse.symmetry.transforms import (
    FFNPermutation,
    HeadPermutation,
    ModuleTransform,
    QKRotation,
    QKScaling,
    Transform,
    VORotation,
    VOScaling,
)

# the per-module kinds registered at import that go together (defaults; the registry is read again at every call);
# a kind replacing earlier ones (head-linear for rotation and scaling) is asked for by name
ALL_KINDS = compatible_kinds(n for n, k in SYMMETRY_KINDS.items() if k.draw is not None and "residual" not in k.acts_on)


def random_orthogonal(n: int, batch: int, generator: torch.Generator) -> torch.Tensor:
    """Haar-random orthogonal matrices, (batch, n, n) float64."""
    a = torch.randn(batch, n, n, generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    return q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))[:, None, :]


def rope_rotation(angles: torch.Tensor) -> torch.Tensor:
    """Block rotations commuting with RoPE (rotate_half layout).

    Args:
        angles: (n, dh/2) angle of each frequency pair ``(i, i + dh/2)``.

    Returns:
        (n, dh, dh) float64: on pair ``(i, i+h)`` the 2x2 block ``[[cos, -sin], [sin, cos]]``.
    """
    n, h = angles.shape
    angles = angles.to(torch.float64)
    c, s = torch.cos(angles), torch.sin(angles)
    r = torch.zeros(n, 2 * h, 2 * h, dtype=torch.float64)
    i = torch.arange(h)
    r[:, i, i] = c
    r[:, i + h, i + h] = c
    r[:, i, i + h] = -s
    r[:, i + h, i] = s
    return r


def draw_head_permutation(ref: ModuleRef, geo: Geometry, g: torch.Generator, log_scale: float) -> tuple[Transform, ...]:
    """A random permutation of the KV groups (query heads move with their group).

    None where one per-head score-bias table is shared by every layer of the stack (``geo.shared_head_bias``, T5
    self-attention): permuting one layer's heads would not be exact.
    """
    if geo.shared_head_bias:
        return ()
    return (HeadPermutation(torch.randperm(geo.n_kv_heads, generator=g)),)


def draw_rotation(ref: ModuleRef, geo: Geometry, g: torch.Generator, log_scale: float) -> tuple[Transform, ...]:
    """Random QK (commuting with RoPE: per frequency pair) and VO rotations per KV group.

    With per-head q/k norms (``geo.qk_norm``, Qwen3) only the identity QK map is exact: no QK rotation is drawn.
    """
    n, dh = geo.n_kv_heads, geo.head_dim
    parts: list[Transform] = []
    if geo.qk_norm:
        pass
    elif geo.rope:
        angles = (torch.rand(n, dh // 2, generator=g, dtype=torch.float64) * 2 - 1) * math.pi
        parts.append(QKRotation(rope_rotation(angles)))
    else:
        parts.append(QKRotation(random_orthogonal(dh, n, g)))
    parts.append(VORotation(random_orthogonal(dh, n, g)))
    return tuple(parts)


def draw_scaling(ref: ModuleRef, geo: Geometry, g: torch.Generator, log_scale: float) -> tuple[Transform, ...]:
    """Random QK (per head, or per frequency pair under RoPE) and VO (per head) scales ``exp(U(-l, l))``.

    With per-head q/k norms (``geo.qk_norm``) no QK scaling is drawn (not exact).
    """
    n, dh = geo.n_kv_heads, geo.head_dim

    def draw(cols: int) -> torch.Tensor:
        return torch.exp((torch.rand(n, cols, generator=g, dtype=torch.float64) * 2 - 1) * log_scale)

    parts: list[Transform] = []
    if not geo.qk_norm:
        s = draw(dh // 2).repeat(1, 2) if geo.rope else draw(1).expand(n, dh).contiguous()
        parts.append(QKScaling(s))
    parts.append(VOScaling(draw(1).expand(n, dh).contiguous()))
    return tuple(parts)


def draw_ffn_permutation(ref: ModuleRef, geo: Geometry, g: torch.Generator, log_scale: float) -> tuple[Transform, ...]:
    """A random permutation of the FFN's hidden neurons."""
    return (FFNPermutation(torch.randperm(geo.d_ffn, generator=g)),)


def draw_residual_permutation(
    ref: ModuleRef | None, geo: Geometry, g: torch.Generator, log_scale: float
) -> tuple[Transform, ...]:
    """A random permutation of the whole residual stream (``ref`` is unused: one for the model)."""
    return (ResidualPermutation(torch.randperm(geo.d_model, generator=g)),)


def draw_residual_orthogonal(
    ref: ModuleRef | None, geo: Geometry, g: torch.Generator, log_scale: float
) -> tuple[Transform, ...]:
    """A Haar-random orthogonal map of the stream (``disguise`` restricts it to the family's group)."""
    from symfuse.symmetry.residual_orthogonal import ResidualOrthogonal, random_in_group

    return (ResidualOrthogonal(random_in_group(geo.d_model, "orthogonal", g)),)


def random_module_transform(
    ref: ModuleRef,
    geo: Geometry,
    generator: torch.Generator,
    kinds: Sequence[str] = ALL_KINDS,
    log_scale: float = 0.5,
) -> ModuleTransform:
    """A random exact (function-preserving) transform of one module.

    The parts are drawn kind by kind in stage order (attention: head permutation, QK / VO rotations, QK / VO
    scalings; FFN: neuron permutation); kinds acting on another module or on the residual stream are skipped.

    Args:
        ref: The module.
        geo: The model's geometry (its stack's, ``geo.of(ref.stack)``, is used; RoPE restricts QK rotations and
            scales to frequency pairs; with per-head q/k norms, ``geo.qk_norm``, no QK rotation or scaling is
            drawn, and with a per-head score bias shared by all layers, ``geo.shared_head_bias``, no head
            permutation: they would not be exact).
        generator: Random source.
        kinds: Symmetry kinds to draw from (registered kinds with a ``draw``; see :data:`ALL_KINDS`).
        log_scale: Scales are ``exp(U(-log_scale, log_scale))``.

    Raises:
        UnknownChoiceError: a kind is not registered or has no random draw.
    """
    check_kinds(kinds, "draw", "disguise kinds")
    parts: list[Transform] = []
    geo = geo.of(ref.stack)
    for kind in kinds_for(kinds, ref.kind):
        parts += kind.fn("draw")(ref, geo, generator, log_scale)
    return ModuleTransform(ref.key, tuple(parts))
