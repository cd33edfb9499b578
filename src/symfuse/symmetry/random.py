"""Random exact symmetry transforms (used to disguise a model and in tests)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from symfuse.arch import Geometry, ModuleRef
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

ALL_KINDS = ("rotation", "scaling", "ffn-permutation", "head-permutation")


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


def random_module_transform(
    ref: ModuleRef,
    geo: Geometry,
    generator: torch.Generator,
    kinds: Sequence[str] = ALL_KINDS,
    log_scale: float = 0.5,
) -> ModuleTransform:
    """A random exact (function-preserving) transform of one module.

    Order of parts: head permutation, QK / VO rotations, QK / VO scalings (attention); FFN permutation.

    Args:
        ref: The module.
        geo: The model's geometry (its stack's, ``geo.of(ref.stack)``, is used; RoPE restricts QK rotations and
            scales to frequency pairs; with per-head q/k norms, ``geo.qk_norm``, no QK rotation or scaling is
            drawn, and with a per-head score bias shared by all layers, ``geo.shared_head_bias``, no head
            permutation: they would not be exact).
        generator: Random source.
        kinds: Symmetry kinds to draw from (see :data:`ALL_KINDS`).
        log_scale: Scales are ``exp(U(-log_scale, log_scale))``.
    """
    parts: list[Transform] = []
    g = generator
    geo = geo.of(ref.stack)
    if ref.kind == "ffn":
        if "ffn-permutation" in kinds:
            parts.append(FFNPermutation(torch.randperm(geo.d_ffn, generator=g)))
        return ModuleTransform(ref.key, tuple(parts))
    n, dh = geo.n_kv_heads, geo.head_dim
    if "head-permutation" in kinds and not geo.shared_head_bias:  # T5: the bias table is shared by all layers
        parts.append(HeadPermutation(torch.randperm(n, generator=g)))
    qk = not geo.qk_norm  # per-head q/k RMSNorm (Qwen3): only the identity QK map is exact (see qwen3.yaml)
    if "rotation" in kinds:
        if not qk:
            pass
        elif geo.rope:
            angles = (torch.rand(n, dh // 2, generator=g, dtype=torch.float64) * 2 - 1) * math.pi
            parts.append(QKRotation(rope_rotation(angles)))
        else:
            parts.append(QKRotation(random_orthogonal(dh, n, g)))
        parts.append(VORotation(random_orthogonal(dh, n, g)))
    if "scaling" in kinds:

        def draw(cols: int) -> torch.Tensor:
            return torch.exp((torch.rand(n, cols, generator=g, dtype=torch.float64) * 2 - 1) * log_scale)

        if qk:
            s = draw(dh // 2).repeat(1, 2) if geo.rope else draw(1).expand(n, dh).contiguous()
            parts.append(QKScaling(s))
        parts.append(VOScaling(draw(1).expand(n, dh).contiguous()))
    return ModuleTransform(ref.key, tuple(parts))
