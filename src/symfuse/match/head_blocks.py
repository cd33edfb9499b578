"""Per-head blocks of an attention module's weights and their cross products with the anchor's.

The shared ground of :mod:`symfuse.match.weights` (rotation, scaling, head permutation) and
:mod:`symfuse.match.head_linear` (the general linear maps per head).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, MutableMapping, Sequence

import torch

from symfuse.arch import Geometry

Timings = MutableMapping[str, float]


def _tick(timings: Timings | None, name: str, t0: float) -> float:
    now = time.perf_counter()
    if timings is not None:
        timings[name] = timings.get(name, 0.0) + now - t0
    return now


def _heads(w: torch.Tensor, n_kv: int, dh: int) -> torch.Tensor:
    """Rows of a per-head weight (heads*dh, cols) or bias (heads*dh,) -> (n_kv, dh, G*cols) float64."""
    w = w.to(torch.float64)
    cols = 1 if w.dim() == 1 else w.shape[1]
    g = w.shape[0] // (n_kv * dh)
    return w.reshape(n_kv, g, dh, cols).permute(0, 2, 1, 3).reshape(n_kv, dh, g * cols)


def attention_blocks(w: Mapping[str, torch.Tensor], geo: Geometry) -> dict[str, torch.Tensor]:
    """Per-group stacked blocks ``{"q": A, "k": B, "v": A, "o": B}``, each (n_kv, dh, cols) float64."""
    n, dh = geo.n_kv_heads, geo.head_dim

    def stack(roles: Sequence[str]) -> torch.Tensor:
        return torch.cat([_heads(w[r], n, dh) for r in roles if r in w], dim=-1)

    return {
        "q": stack(("q", "q_bias", "pos_q", "pos_q_bias")),
        "k": stack(("k", "k_bias", "pos_k", "pos_k_bias")),
        "v": stack(("v", "v_bias")),
        "o": _heads(w["o"].t(), n, dh),
    }


def _cross(src: torch.Tensor, anc: torch.Tensor, pairs: bool) -> torch.Tensor:
    """``A* A^T`` per group (n, dh, dh) or for every (source i, anchor j) pair (n, n, dh, dh)."""
    if pairs:
        return torch.einsum("jan,ibn->ijab", anc, src)
    return anc @ src.transpose(-1, -2)


_SIDES = {
    "q": ("q", "q_bias", "pos_q", "pos_q_bias"),
    "k": ("k", "k_bias", "pos_k", "pos_k_bias"),
    "v": ("v", "v_bias"),
    "o": ("o",),
}


def _group_view(w: torch.Tensor, role: str, n_kv: int, dh: int) -> torch.Tensor:
    """A role's per-head rows as a (n_kv, G, dh, cols) VIEW (no copy, stored dtype); ``o`` is read transposed."""
    t = w.t() if role == "o" else w
    if t.dim() == 1:
        t = t[:, None]
    return t.reshape(n_kv, -1, dh, t.shape[-1])


def side_stats(
    src: Mapping[str, torch.Tensor],
    anc: Mapping[str, torch.Tensor],
    side: str,
    geo: Geometry,
    chunk: int = 1 << 21,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross matrix ``A* A^T`` (n_kv, dh, dh) and source row norms ``|A_r|²`` (n_kv, dh) of one side, float64.

    Equal to ``_cross`` / ``**2`` of :func:`attention_blocks` (same float64 products), but streamed role by role
    and over chunks of groups (:func:`side_products`).

    Args:
        src: Source canonical weights.
        anc: Anchor canonical weights.
        side: ``q``, ``k``, ``v`` or ``o`` (roles in :data:`_SIDES`).
        geo: Geometry.
        chunk: Float64 elements converted at once (per model).
    """
    p = side_products(src, anc, side, geo, grams=False, chunk=chunk)
    return p["cross"], p["norms"]


def side_products(
    src: Mapping[str, torch.Tensor],
    anc: Mapping[str, torch.Tensor],
    side: str,
    geo: Geometry,
    grams: bool,
    chunk: int = 1 << 21,
) -> dict[str, torch.Tensor]:
    """Products of one side's per-group blocks ``A`` (source) and ``A*`` (anchor) over d_model, float64.

    Streamed role by role and over chunks of groups: no float64 copy of a whole weight, no concatenation (memory
    O(``chunk``)); computed on the weights' device.

    Args:
        src: Source canonical weights.
        anc: Anchor canonical weights.
        side: ``q``, ``k``, ``v`` or ``o`` (roles in :data:`_SIDES`).
        geo: Geometry.
        grams: Also the full Grams (else the source's row norms only).
        chunk: Float64 elements converted at once (per model).

    Returns:
        ``cross`` = ``A* A^T`` (n_kv, dh, dh) and ``norms`` = ``|A_r|²`` (n_kv, dh); with ``grams`` also
        ``src`` = ``A A^T`` and ``anc`` = ``A* A*^T`` (n_kv, dh, dh).
    """
    n, dh = geo.n_kv_heads, geo.head_dim
    f64 = torch.float64
    device = src[_SIDES[side][0]].device
    out = {"cross": torch.zeros(n, dh, dh, dtype=f64, device=device)}
    out["norms"] = torch.zeros(n, dh, dtype=f64, device=device)
    if grams:
        out["src"], out["anc"] = (torch.zeros(n, dh, dh, dtype=f64, device=device) for _ in range(2))
    for role in _SIDES[side]:
        if role not in src:
            continue
        s, a = _group_view(src[role], role, n, dh), _group_view(anc[role], role, n, dh)
        step = max(1, chunk // max(1, s[0].numel()))
        for i in range(0, n, step):
            sd, ad = s[i : i + step].to(f64), a[i : i + step].to(f64)  # (c, G, dh, cols)
            out["cross"][i : i + step] += (ad @ sd.transpose(-1, -2)).sum(1)
            out["norms"][i : i + step] += sd.square().sum(-1).sum(1)
            if grams:
                out["src"][i : i + step] += (sd @ sd.transpose(-1, -2)).sum(1)
                out["anc"][i : i + step] += (ad @ ad.transpose(-1, -2)).sum(1)
    return out
