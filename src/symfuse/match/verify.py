"""Per-module checks that a matched model still computes its source's function, cheap enough to run on every match.

:func:`check_module_transform`: while a module's transform is applied, the invariants it must keep are compared on a
few random probe inputs (float64 for float32 / float64 weights): per query head the scores
``(Q_h x + b) . (K_g y + b)`` (and the DeBERTa ``pos_q`` / ``pos_k`` cross terms; under RoPE also with the keys turned
by a fixed pair rotation, which only RoPE-commuting QK maps keep), per head the output contribution
``O_h (V_g x + b)``, and for the FFN ``down act(up x + b)`` (gated: ``act(gate x) * up x``). Attention permutations
must keep them to float64 rounding, rotations, scalings and invertible maps to a few units of the stored dtype's
rounding (times the maps' condition number); the FFN (permutations; computed in float32 without copies) to 1e-4. A
failure is a :class:`~symfuse.errors.VerificationError` naming the module and head.

The whole-model output checks (logits of the written checkpoint against its source) are in
:mod:`symfuse.match.output_check`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from symfuse.arch import Geometry, ModuleRef
from symfuse.errors import VerificationError
from symfuse.symmetry.registry import kind_of_part
from symfuse.symmetry.transforms import FFNPermutation, HeadPermutation, ModuleTransform

N_PROBES = 4
EXACT_TOL = 1e-9  # permutations only: the probes differ by float64 summation order alone
FLOAT32_TOL = 1e-4  # checks computed in float32: its summation-order noise over a few thousand terms
ROUNDING_TOL = 16  # rotations / scalings: units of the stored dtype's epsilon


def _tol(mt: ModuleTransform | None, weights: Mapping[str, torch.Tensor]) -> float:
    if mt is None or all(isinstance(p, (FFNPermutation, HeadPermutation)) for p in mt.parts):
        return EXACT_TOL
    eps = max(torch.finfo(t.dtype).eps for t in weights.values() if t.is_floating_point())
    # an invertible map M rounds the stored weights relative to |M x|, which may exceed |x| by cond(M)
    return ROUNDING_TOL * eps * max(p.condition() for p in mt.parts)


def _work(weights: Mapping[str, torch.Tensor]) -> torch.dtype:
    half = any(t.dtype in (torch.float16, torch.bfloat16) for t in weights.values())
    return torch.float32 if half else torch.float64


def _proj(w: Mapping[str, torch.Tensor], role: str, x: torch.Tensor) -> torch.Tensor:
    y = w[role].to(x.dtype) @ x
    b = w.get(role + "_bias")
    return y + b.to(x.dtype)[:, None] if b is not None else y


def _rel(new: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Relative Frobenius change per leading index (NaN counts as a failure)."""
    d = (new - ref).flatten(1).norm(dim=1)
    return d / ref.flatten(1).norm(dim=1).clamp_min(torch.finfo(ref.dtype).tiny)


def _attn_invariants(w: Mapping[str, torch.Tensor], geo: Geometry, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per head: QK scores (each q-side x k-side role pair) and the V/O output contribution, on probes ``x``."""
    nh, nkv, dh, p = geo.n_heads, geo.n_kv_heads, geo.head_dim, x.shape[1]
    y = x.flip(1)  # second probe set for the key side
    group = torch.arange(nh, device=x.device) // (nh // nkv)
    out = {}
    for qr in ("q", "pos_q"):
        for kr in ("k", "pos_k"):
            if qr in w and kr in w:
                q = _proj(w, qr, x).reshape(nh, dh, p)
                k = _proj(w, kr, y).reshape(nkv, dh, p)[group]
                out[f"{qr}.{kr} scores"] = torch.einsum("hdp,hdr->hpr", q, k)
                if geo.rope and qr == "q" and kr == "k":  # the keys at another position: RoPE between q and k
                    out["q.k scores across positions"] = torch.einsum("hdp,hdr->hpr", q, _rope_turn(k))
    v = _proj(w, "v", x).reshape(nkv, dh, p)[group]  # (nh, dh, p)
    o = w["o"].to(x.dtype).reshape(w["o"].shape[0], nh, dh)
    out["V.O output"] = torch.einsum("ehd,hdp->hep", o, v)
    return out


def _rope_turn(k: torch.Tensor) -> torch.Tensor:
    """``k`` (heads, dh, probes) turned by a fixed RoPE-like rotation: angle ``0.7 (i + 1)`` on pair ``(i, i + dh/2)``.

    A QK map keeps ``q^T R k`` for every such rotation ``R`` only if it commutes with them (a scaled rotation per
    pair): the check then sees a map that RoPE does not allow, which the plain scores do not.
    """
    h = k.shape[1] // 2
    angle = 0.7 * torch.arange(1, h + 1, dtype=k.dtype, device=k.device)[None, :, None]
    c, s = torch.cos(angle), torch.sin(angle)
    a, b = k[:, :h], k[:, h:]
    return torch.cat([c * a - s * b, s * a + c * b], dim=1)


def _ffn_invariant(w: Mapping[str, torch.Tensor], x: torch.Tensor) -> dict[str, torch.Tensor]:
    h = torch.tanh(_proj(w, "up", x))
    if "gate" in w:
        h = h * torch.tanh(_proj(w, "gate", x))
    return {"FFN output": (w["down"].to(x.dtype) @ h)[None]}


def _head_order(transform: ModuleTransform | None, geo: Geometry) -> torch.Tensor:
    """New query head j = old query head ``order[j]`` (the head permutations of ``transform``, composed)."""
    groups = torch.arange(geo.n_kv_heads)
    for p in transform.parts if transform is not None else ():
        if isinstance(p, HeadPermutation):
            groups = groups[p.perm.cpu()]
    g = geo.n_heads // geo.n_kv_heads
    return (groups[:, None] * g + torch.arange(g)[None, :]).reshape(-1)


def is_exact(transform: ModuleTransform) -> bool:
    """Whether every part of ``transform`` comes from an exact symmetry kind (unregistered parts count as exact).

    A part of an inexact kind (OT's soft transport maps) changes the module's function by design: it is not
    held to :func:`check_module_transform`'s invariants.
    """
    kinds = [kind_of_part(p.name) for p in transform.parts]
    return all(k is None or k.exact for k in kinds)


@dataclass(frozen=True)
class ModuleInvariants:
    """What :func:`check_module_transform` compares, taken from a module before its transform.

    Attributes:
        roles: Each role's shape and dtype.
        values: The invariants on the probes (per head / per FFN).
        dtype: The probes' dtype.
    """

    roles: dict[str, tuple[tuple[int, ...], torch.dtype]]
    values: dict[str, torch.Tensor]
    dtype: torch.dtype


def _invariants(ref: ModuleRef, w: Mapping[str, torch.Tensor], geo: Geometry, dtype: torch.dtype) -> dict:
    g = torch.Generator().manual_seed(1234 + 2 * ref.layer + (ref.kind == "ffn"))
    device = next(iter(w.values())).device  # the probes are drawn on the CPU: the same on every device
    x = torch.randn(geo.d_model, N_PROBES, generator=g, dtype=dtype).to(device)
    return _attn_invariants(w, geo, x) if ref.kind == "attn" else _ffn_invariant(w, x)


def module_invariants(ref: ModuleRef, weights: Mapping[str, torch.Tensor], geo: Geometry) -> ModuleInvariants:
    """A module's invariants before its transform, so the weights can be freed before the transformed ones are checked.

    Args:
        ref: The module.
        weights: Its canonical weights.
        geo: Model geometry (heads, head size).
    """
    geo = geo.of(ref.stack)  # multi-stack families (T5, CLIP): the module's own stack
    # attention in float64 (rotations are checked to the stored dtype's rounding); the FFN (permutations only,
    # the big matrices) in float32 without copies, to float32 summation-order noise
    dtype = _work(weights) if ref.kind == "attn" else torch.float32
    roles = {role: (tuple(t.shape), t.dtype) for role, t in weights.items()}
    return ModuleInvariants(roles, _invariants(ref, weights, geo, dtype), dtype)


def check_module_transform(
    ref: ModuleRef,
    old: Mapping[str, torch.Tensor] | ModuleInvariants,
    new: Mapping[str, torch.Tensor],
    geo: Geometry,
    transform: ModuleTransform | None = None,
    where: str = "",
) -> float:
    """Check that ``new`` (the transformed module) computes what ``old`` does, on random probes.

    Args:
        ref: The module.
        old: Its canonical weights before the transform, or their :func:`module_invariants`.
        new: After the transform, in the stored dtype.
        geo: Model geometry (heads, head size).
        transform: The transform applied (permutations alone are held to float64 rounding).
        where: Names the artifact in the error (e.g. the output folder).

    Returns:
        The largest relative change seen (per head / per FFN, Frobenius over probes).

    Raises:
        VerificationError: a role missing or changed in shape / dtype, or an invariant broken beyond rounding.
    """
    before = old if isinstance(old, ModuleInvariants) else module_invariants(ref, old, geo)
    geo = geo.of(ref.stack)
    prefix = f"{where}: " if where else ""
    for role, (shape, dtype) in before.roles.items():
        if role not in new or tuple(new[role].shape) != shape or new[role].dtype != dtype:
            got = (tuple(new[role].shape), new[role].dtype) if role in new else None
            raise VerificationError(
                f"{prefix}module {ref.key}: role {role!r} is {got} after the transform, {(shape, dtype)} "
                "before — the transform is not a symmetry of this module; nothing was published"
            )
    after = _invariants(ref, new, geo, before.dtype)
    tol = max(_tol(transform, new), FLOAT32_TOL if before.dtype == torch.float32 else 0.0)
    heads = _head_order(transform, geo) if ref.kind == "attn" else None
    worst = 0.0
    for what, b in before.values.items():
        rel = _rel(after[what], b if heads is None else b[heads.to(b.device)])
        bad = ~(rel <= tol)
        if bool(bad.any()):
            h = int(bad.nonzero()[0, 0])
            head = f" head {h}" if ref.kind == "attn" else ""
            raise VerificationError(
                f"{prefix}module {ref.key}: the transform changes the {what}{head} by {float(rel[h]):.1e} "
                f"(relative; rounding allows {tol:.0e}) — the matched weights are wrong; nothing was published"
            )
        worst = max(worst, float(rel.max()))
    return worst
