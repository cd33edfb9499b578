"""Weight-based matching of one module (closed form): the transform mapping SOURCE's weights onto ANCHOR's.

Attention, per KV group ``g`` (float64): query side ``A_g = [q_h | b_q,h | pos_q,h | ...]`` over the group's query
heads ``h``, key side ``B_g = [k_g | b_k,g | pos_k,g | ...]`` (QK), and ``A_g = [v_g | b_v,g]``,
``B_g = [o_h^T ...]`` (VO). Order: head permutation (Hungarian on the per-pair residual after optimal rotation and
scaling), then rotations (RoPE-restricted for QK under RoPE) and scales. Rotation and scaling together are solved
JOINTLY (:func:`symfuse.match.joint.joint_rotation_scale`), so the result depends only on the source's orbit:
an exactly equivalent source (rotated / scaled heads) matches to the same weights.
With per-head q/k norms (``Geometry.qk_norm``, Qwen3) QK maps are not exact: only the head permutation and V/O
maps are fitted.
With ``head-linear`` (any invertible map per group, in place of rotation and scaling) the heads are paired on their
QK / OV circuits and the maps fitted by :func:`symfuse.match.head_linear.match_head_linear`.
FFN: Hungarian on ``W_in W_in*^T + b b*^T (+ W_gate W_gate*^T) + W_out^T W_out*`` in float32.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence

import torch

from symfuse.arch import Geometry, ModuleRef
from symfuse.match.closed_form import assign_max, fit_rotation_scale
from symfuse.match.head_blocks import (  # noqa: F401  (attention_blocks, side_products: names of this interface)
    _SIDES,
    Timings,
    _cross,
    _tick,
    attention_blocks,
    side_products,
    side_stats,
)
from symfuse.match.sketch import certified_nearest
from symfuse.symmetry.registry import SYMMETRY_KINDS, check_kinds, compatible_kinds, kinds_for, module_kind_names
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

log = logging.getLogger(__name__)

# the EXACT kinds found from weights that were registered at import and go together (every call reads
# symfuse.symmetry.registry; the inexact ones, e.g. OT's soft alignment, and head-linear replace some of these:
# kind_names("weights"))
SYMMETRIES = compatible_kinds(n for n in module_kind_names("weights") if SYMMETRY_KINDS[n].exact)
DEFAULT_SYMMETRIES = ("rotation", "scaling", "ffn-permutation")


def check_symmetries(symmetries: Sequence[str]) -> tuple[str, ...]:
    """Validate symmetry names: registered kinds that can be found from weights.

    Raises:
        UnknownChoiceError: (a ValueError) naming the unknown ones and the accepted names.
    """
    return check_kinds(symmetries, "weights")


def match_attention(
    src: Mapping[str, torch.Tensor],
    anc: Mapping[str, torch.Tensor],
    geo: Geometry,
    symmetries: Sequence[str],
    key: str = "",
    timings: Timings | None = None,
) -> ModuleTransform:
    """Transform mapping the source attention module onto the anchor's (see the module docstring).

    Args:
        src: Source canonical weights.
        anc: Anchor canonical weights (same shapes).
        geo: Geometry (heads, head size, RoPE).
        symmetries: The asked kinds; this finder reads ``rotation``, ``scaling`` and ``head-permutation``, and
            hands ``head-linear`` (with ``head-permutation``) to :func:`symfuse.match.head_linear.match_head_linear`.
        key: Module key recorded in the result.
        timings: Accumulates seconds under ``svd``, ``scaling``, ``head_perm``.
    """
    if "head-linear" in symmetries:  # the larger group replacing rotation and scaling, with its own head pairing
        from symfuse.match.head_linear import match_head_linear  # it builds on this module's products

        return match_head_linear(src, anc, geo, "head-permutation" in symmetries, key, timings)
    rotate, scale = "rotation" in symmetries, "scaling" in symmetries
    # per-head q/k RMSNorm with learned weights (Qwen3): a QK rotation or scaling would change the function
    qk_ok = not geo.qk_norm
    if not qk_ok and (rotate or scale):
        log.debug("%s: per-head q/k norms: QK rotation / scaling skipped (not exact); V/O maps kept", key)
    maps = {"qk": (rotate and qk_ok, scale and qk_ok), "vo": (rotate, scale)}
    rope = geo.rope
    t0 = time.perf_counter()
    parts: list[Transform] = []
    # a per-head score bias shared by every layer (T5): a head permutation of one layer would change it
    if "head-permutation" in symmetries and geo.n_kv_heads > 1 and not geo.shared_head_bias:
        sb, ab = attention_blocks(src, geo), attention_blocks(anc, geo)
        sb_device = sb["q"].device
        cost = torch.zeros(geo.n_kv_heads, geo.n_kv_heads, dtype=torch.float64)
        for name, a_role, b_role, use_rope in (("qk", "q", "k", rope), ("vo", "v", "o", False)):
            # the products on the weights' device, the small per-pair fits on the CPU
            ma, mb = _cross(sb[a_role], ab[a_role], True).cpu(), _cross(sb[b_role], ab[b_role], True).cpu()
            na = (sb[a_role] ** 2).sum(-1)[:, None].expand(-1, geo.n_kv_heads, -1).cpu()
            nb = (sb[b_role] ** 2).sum(-1)[:, None].expand(-1, geo.n_kv_heads, -1).cpu()
            _, _, obj = fit_rotation_scale(ma, mb, na, nb, *maps[name], use_rope)
            cost += obj  # anchor norms are the same for every source head: omitted
        del sb, ab
        perm, _ = assign_max(-cost)
        hp = HeadPermutation(perm)
        parts.append(hp)
        src = hp.to(sb_device).apply(src)
        t0 = _tick(timings, "head_perm", t0)
    if rotate or scale:
        # cross products on the weights' device; the per-head rotations / scales (dh x dh) are solved on the CPU
        stats = {side: tuple(x.cpu() for x in side_stats(src, anc, side, geo)) for side in _SIDES}
        fits = {}
        for name, a_role, b_role, use_rope in (("qk", "q", "k", rope), ("vo", "v", "o", False)):
            (ma, na), (mb, nb) = stats[a_role], stats[b_role]
            fits[name] = fit_rotation_scale(ma, mb, na, nb, *maps[name], use_rope)
        t0 = _tick(timings, "svd", t0)
        if rotate:
            parts += [QKRotation(fits["qk"][0].contiguous())] if qk_ok else []
            parts += [VORotation(fits["vo"][0].contiguous())]
        if scale:
            parts += [QKScaling(fits["qk"][1].contiguous())] if qk_ok else []
            parts += [VOScaling(fits["vo"][1].contiguous())]
        _tick(timings, "scaling", t0)
    return ModuleTransform(key, tuple(parts))


def ffn_similarity(src: Mapping[str, torch.Tensor], anc: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``S[i, j] = <s_i, a_j> - ½|s_i|² - ½|a_j|²`` over up (+gate) rows, biases and down columns (float32).

    ``s_i`` / ``a_j``: source / anchor neuron features. Maximising ``sum_j S[perm[j], j]`` over permutations is
    the Hungarian problem on ``W_in W_in*^T + b b*^T + W_out^T W_out*`` (the norm terms are constant per row or
    column, so they do not change the optimum).
    """
    f32 = torch.float32
    sim = torch.matmul(src["up"].to(f32), anc["up"].to(f32).T)  # (d_ffn, d_ffn)
    if "gate" in src:
        sim.addmm_(src["gate"].to(f32), anc["gate"].to(f32).T)
    for b in ("up_bias", "gate_bias"):
        if b in src:
            sim.addr_(src[b].to(f32), anc[b].to(f32))
    sim.addmm_(src["down"].to(f32).T, anc["down"].to(f32))
    # -½|s_i|² and -½|a_j|²: row / column constants leave the assignment optimum unchanged, and make
    # sim = -½||s_i - a_j||², whose row argmax is the nearest neighbour (so the exact fast path fires when planted)
    sim.sub_(0.5 * _neuron_sqnorms(src)[:, None]).sub_(0.5 * _neuron_sqnorms(anc)[None, :])
    return sim


def _neuron_sqnorms(w: Mapping[str, torch.Tensor]) -> torch.Tensor:
    f32 = torch.float32
    n = (w["up"].to(f32) ** 2).sum(1) + (w["down"].to(f32) ** 2).sum(0)
    if "gate" in w:
        n += (w["gate"].to(f32) ** 2).sum(1)
    for b in ("up_bias", "gate_bias"):
        if b in w:
            n += w[b].to(f32) ** 2
    return n


def match_ffn(
    src: Mapping[str, torch.Tensor],
    anc: Mapping[str, torch.Tensor],
    symmetries: Sequence[str],
    key: str = "",
    timings: Timings | None = None,
    sketch: bool = True,
) -> ModuleTransform:
    """Transform mapping the source FFN onto the anchor's: the neuron permutation solving the Hungarian problem.

    Exact fast paths, tried in order: certified nearest neighbours from a sketch (:mod:`symfuse.match.sketch`;
    no full cost matrix), then row / column argmax of the full cost matrix (:func:`assign_max`); else Hungarian.
    """
    if "ffn-permutation" not in symmetries:
        return ModuleTransform(key, ())
    t0 = time.perf_counter()
    sketch = sketch and src["up"].device.type == "cpu"  # a device computes the full cost matrix at once
    nn = certified_nearest(src, anc) if sketch else None
    t0 = _tick(timings, "ffn_sketch", t0)
    if nn is not None and torch.bincount(nn, minlength=nn.numel()).max() == 1:
        # every source neuron's exact nearest anchor neuron is distinct: each row of the Hungarian problem
        # sits at its maximum, so this permutation is optimal
        perm = torch.empty_like(nn)
        perm[nn] = torch.arange(nn.numel())
        log.debug("%s: ffn permutation certified from the sketch", key)
        return ModuleTransform(key, (FFNPermutation(perm),))
    sim = ffn_similarity(src, anc)
    t0 = _tick(timings, "ffn_cost", t0)
    perm, ran = assign_max(sim)
    _tick(timings, "hungarian", t0)
    log.debug("%s: ffn permutation (%s)", key, "hungarian" if ran else "argmax fast path")
    return ModuleTransform(key, (FFNPermutation(perm),))


def find_ffn_permutation(
    src: Mapping[str, torch.Tensor],
    anc: Mapping[str, torch.Tensor],
    geo: Geometry,
    symmetries: Sequence[str],
    key: str = "",
    timings: Timings | None = None,
) -> ModuleTransform:
    """The ``ffn-permutation`` kind's weight finder: :func:`match_ffn` (``geo`` unused)."""
    return match_ffn(src, anc, symmetries, key, timings)


def match_module_weights(
    ref: ModuleRef | str,
    src: Mapping[str, torch.Tensor],
    anc: Mapping[str, torch.Tensor],
    geo: Geometry,
    symmetries: Sequence[str] = DEFAULT_SYMMETRIES,
    timings: Timings | None = None,
) -> ModuleTransform:
    """Match one module given its canonical weights (in memory).

    Args:
        ref: The module (or its key).
        src: Source canonical weights.
        anc: Anchor canonical weights.
        geo: Geometry of both models (a multi-stack geometry: the module's stack is used).
        symmetries: Registered kinds with a weight finder (see :data:`SYMMETRIES`).
        timings: Accumulates seconds per stage.

    Returns:
        The :class:`ModuleTransform` with ``transform.apply(src) ≈ anc``: the finders of the asked kinds acting on
        this module, each called once (kinds sharing a finder are solved jointly), in stage order, each on the
        source as the previous ones moved it.
    """
    ref = ModuleRef.parse(ref) if isinstance(ref, str) else ref
    check_symmetries(symmetries)
    geo = geo.of(ref.stack) if geo is not None else None  # FFN finders need no geometry
    finders: list = []
    for kind in kinds_for(symmetries, ref.kind, "weights"):
        if kind.fn("weights") not in finders:
            finders.append(kind.fn("weights"))
    parts: list[Transform] = []
    for i, find in enumerate(finders):
        t = find(src, anc, geo, symmetries, ref.key, timings)
        parts += t.parts
        if i + 1 < len(finders):
            src = t.apply(src)
    return ModuleTransform(ref.key, tuple(parts))


def sq_distance(a: torch.Tensor, b: torch.Tensor, chunk: int = 1 << 22) -> float:
    """``||a - b||²`` accumulated in float64, in row chunks (bounded memory for big half-precision tensors)."""
    a2, b2 = (t.reshape(t.shape[0], -1) if t.dim() else t.reshape(1, 1) for t in (a, b))
    rows = max(1, chunk // max(1, a2.shape[1]))
    total = 0.0
    for i in range(0, a2.shape[0], rows):
        d = a2[i : i + rows].to(torch.float64) - b2[i : i + rows].to(torch.float64)
        total += float((d * d).sum())
    return total


def state_sq_distance(
    a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], skip: frozenset = frozenset()
) -> float:
    """``sum ||a - b||²`` over the floating tensors both hold with one shape, less the names in ``skip`` (float64)."""
    return sum(
        sq_distance(a[n], b[n])
        for n in a.keys() & b.keys() - skip
        if a[n].is_floating_point() and a[n].shape == b[n].shape
    )


def module_distance(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    """Frobenius distance over the roles both share (float64 accumulation, chunked)."""
    return sum(sq_distance(a[r], b[r]) for r in a.keys() & b.keys()) ** 0.5
