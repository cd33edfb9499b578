"""The ``head-linear`` kind's weight finder: heads paired on their circuits, then the closest invertible maps.

1. Head permutation (with ``head-permutation``, more than one KV group, no per-head bias shared by the layers): KV
   groups are paired on their circuits, which every invertible map leaves unchanged. Per query head ``h`` of group
   ``g``, ``QK_h = Â_h^T B̂_g`` and ``OV_h = Ô_h^T V̂_g``, where hats are the blocks of
   :func:`~symfuse.match.weights.attention_blocks` (rows, with biases and position rows as extra columns), so
   ``QK_h`` is ``W_Q^h W_K^{hT}`` (d x d) bordered by its bias terms. The cost of source group ``i`` against anchor
   group ``j`` is ``sum_h ||QK_ih − QK*_jh||² + ||OV_ih − OV*_jh||²``; without its norms (constant per row or
   column, so the assignment does not see them) it is ``−2 (<Cq, Ck> + <Cv, Co>)`` with the dh x dh cross products
   ``C = X* X^T`` of each side (the key and value sides are shared by the group's query heads, so the sum over them
   is the product of the summed crosses). No d x d matrix is formed; the products run on the weights' device.
2. Per group the invertible maps closest to the anchor (:func:`~symfuse.match.linear_fit.closest_linear`, started
   from the joint rotation + scale solution and never worse than it): QK (``Q -> M Q``, ``K -> M^{-T} K``) and VO
   (``V -> M V``, ``O^T -> M^{-T} O^T``). Under RoPE the QK map must be a scaled rotation per frequency pair, which
   is exactly RoPE's rotation and scaling subgroup: the joint rotation + scale solution is its optimum and is kept.
   With per-head q/k norms (Qwen3) no QK map is fitted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

import torch

from symfuse.arch import Geometry
from symfuse.match.closed_form import assign_max, fit_rotation_scale
from symfuse.match.head_blocks import Timings, _cross, _tick, attention_blocks, side_products
from symfuse.match.linear_fit import CircuitGrams, closest_linear
from symfuse.symmetry.head_linear import QKLinear, VOLinear
from symfuse.symmetry.transforms import HeadPermutation, ModuleTransform, Transform

log = logging.getLogger(__name__)

_CIRCUITS = (("qk", "q", "k"), ("vo", "v", "o"))  # (name, side mapped by M, side mapped by M^{-T})


def circuit_similarity(src: Mapping[str, torch.Tensor], anc: Mapping[str, torch.Tensor], geo: Geometry) -> torch.Tensor:
    """``S[i, j] = sum_h <QK_ih, QK*_jh> + <OV_ih, OV*_jh>`` for source group ``i``, anchor group ``j`` (CPU float64).

    Computed as ``<Ca_ij, Cb_ij>`` per circuit with ``C_ij = X*_j X_i^T`` (dh x dh) on the weights' device.
    """
    sb, ab = attention_blocks(src, geo), attention_blocks(anc, geo)
    sim = torch.zeros(geo.n_kv_heads, geo.n_kv_heads, dtype=torch.float64, device=sb["q"].device)
    for _, a_role, b_role in _CIRCUITS:
        sim += (_cross(sb[a_role], ab[a_role], True) * _cross(sb[b_role], ab[b_role], True)).sum((-2, -1))
    return sim.cpu()


def circuit_grams(
    src: Mapping[str, torch.Tensor], anc: Mapping[str, torch.Tensor], geo: Geometry, a_side: str, b_side: str
) -> CircuitGrams:
    """The dh x dh products of one circuit per group, computed on the weights' device, returned on the CPU."""
    a, b = (side_products(src, anc, side, geo, grams=True) for side in (a_side, b_side))
    return CircuitGrams(*(x.cpu() for x in (a["src"], b["src"], a["cross"], b["cross"], a["anc"], b["anc"])))


def _rotation_scale(g: CircuitGrams, rope: bool) -> torch.Tensor:
    """The joint rotation + scale solution as one map ``diag(s) R`` per group (n_kv, dh, dh)."""
    diag = (torch.diagonal(x, dim1=-2, dim2=-1) for x in (g.gaa, g.gbb))
    rot, scale, _ = fit_rotation_scale(g.ca, g.cb, *diag, True, True, rope)
    return scale[..., :, None] * rot


def fit_circuit(g: CircuitGrams, rope: bool) -> torch.Tensor:
    """The invertible map per group for one circuit: RoPE-restricted (rotation + scale) or closest in GL(dh)."""
    start = _rotation_scale(g, rope)
    return start if rope else closest_linear(start, g)


def match_head_linear(
    src: Mapping[str, torch.Tensor],
    anc: Mapping[str, torch.Tensor],
    geo: Geometry,
    permute: bool,
    key: str = "",
    timings: Timings | None = None,
) -> ModuleTransform:
    """The ``head-linear`` fit of one attention module, after pairing its heads when ``permute`` (module docstring).

    Called by :func:`~symfuse.match.weights.match_attention`, the weight finder shared with ``head-permutation``.

    Args:
        src: The source module's canonical weights (moved onto the anchor).
        anc: The anchor module's, of the same shapes.
        geo: Heads, head size, RoPE, q/k norms, shared head bias.
        permute: Pair the KV groups on their circuits first (``head-permutation`` asked too).
        key: Module key recorded in the result.
        timings: Accumulates seconds under ``head_perm`` and ``head_linear``.

    Returns:
        Parts in order: the head permutation, ``QKLinear`` (not with per-head q/k norms), ``VOLinear``.
    """
    t0 = time.perf_counter()
    parts: list[Transform] = []
    device = src["o"].device
    # a per-head score bias shared by every layer (T5): a head permutation of one layer would change it
    if permute and geo.n_kv_heads > 1 and not geo.shared_head_bias:
        perm, _ = assign_max(circuit_similarity(src, anc, geo))
        parts.append(HeadPermutation(perm))
        src = parts[-1].to(device).apply(src)
        t0 = _tick(timings, "head_perm", t0)
    if geo.qk_norm:
        log.debug("%s: per-head q/k norms: no QK map (not exact); V/O map kept", key)
    for name, a_side, b_side in _CIRCUITS:
        if name == "qk" and geo.qk_norm:
            continue
        mat = fit_circuit(circuit_grams(src, anc, geo, a_side, b_side), geo.rope and name == "qk")
        parts.append((QKLinear if name == "qk" else VOLinear)(mat.contiguous()))
    _tick(timings, "head_linear", t0)
    return ModuleTransform(key, tuple(parts))
