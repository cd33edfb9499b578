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
from collections.abc import Mapping, MutableMapping, Sequence

import torch

from symfuse.arch import Geometry, ModuleRef
from symfuse.match.closed_form import assign_max, fit_rotation_scale
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
Timings = MutableMapping[str, float]


def check_symmetries(symmetries: Sequence[str]) -> tuple[str, ...]:
    """Validate symmetry names: registered kinds that can be found from weights.

    Raises:
        UnknownChoiceError: (a ValueError) naming the unknown ones and the accepted names.
    """
    return check_kinds(symmetries, "weights")


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


def module_distance(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    """Frobenius distance over the roles both share (float64 accumulation, chunked)."""
    return sum(sq_distance(a[r], b[r]) for r in a.keys() & b.keys()) ** 0.5
