"""RoPE pairs ``(i, i + d/2)``: the 2 x 2 blocks a RoPE-commuting rotation is made of.

Shared by :mod:`symfuse.match.closed_form` (Procrustes restricted to RoPE) and :mod:`symfuse.match.joint`.
"""

from __future__ import annotations

import torch


def rope_rotation(v: torch.Tensor) -> torch.Tensor:
    """RoPE rotation (..., d, d) whose pair ``i`` rotates by the angle of ``v[..., i, :]`` (identity where 0)."""
    x, y = v[..., 0], v[..., 1]
    h = x.shape[-1]
    i = torch.arange(h, device=v.device)
    norm = torch.sqrt(x * x + y * y)
    c = torch.where(norm > 0, x / norm.clamp_min(1e-300), torch.ones_like(x))
    s = torch.where(norm > 0, y / norm.clamp_min(1e-300), torch.zeros_like(y))
    r = torch.zeros(*x.shape[:-1], 2 * h, 2 * h, dtype=v.dtype, device=v.device)
    r[..., i, i] = c
    r[..., i + h, i + h] = c
    r[..., i, i + h] = -s
    r[..., i + h, i] = s
    return r


def pair_vectors(m: torch.Tensor) -> torch.Tensor:
    """RoPE pairs ``(i, i + d/2)``: ``(M_ii + M_jj, M_ji − M_ij)`` (..., d/2, 2), whose length is the best score."""
    h = m.shape[-1] // 2
    i = torch.arange(h, device=m.device)
    return torch.stack([m[..., i, i] + m[..., i + h, i + h], m[..., i + h, i] - m[..., i, i + h]], dim=-1)
