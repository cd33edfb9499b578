"""OT fusion: soft alignment by optimal transport (Singh & Jaggi 2020; Imfeld et al., ICLR 2024).

Transport plans between the units of SOURCE and ANCHOR, with uniform marginals, from a ground cost ``C[i, j]``
(source unit ``i``, anchor unit ``j``):

* ``reg == 0``: exact EMD (``ot.emd``, network simplex). With equal widths the plan is a vertex of the scaled
  Birkhoff polytope, i.e. a permutation matrix / n, and it is the optimum of the same assignment problem the
  permutation matchers solve (same cost) — so OT then returns EXACTLY their permutation, as the exact
  :class:`~symfuse.symmetry.transforms.FFNPermutation` / ``HeadPermutation`` / residual permutation parts
  (function-preserving).
* ``reg > 0``: entropic OT (``ot.sinkhorn``, log domain) on the cost rescaled to [0, 1]; the soft alignment
  Imfeld et al. found best for transformers. The plan is not a permutation: the aligned source AVERAGES units
  (:mod:`symfuse.symmetry.transport`) and computes a different function — ``exact: False`` in every report.

Units and costs, in the order Imfeld et al. propagate them (residual stream first, carried through every
layer's reads / writes and norms, then per layer attention heads and FFN neurons, in the aligned residual basis):

=============  ===========================================  ============================================
unit           weights (``ot``, ``ot-soft``)                activations (``ot-acts``, ``ot-acts-soft``)
=============  ===========================================  ============================================
residual       ``||e_i - e*_j||²`` of the stream embedding  ``-sum`` over norm outputs of ``corr(b_i, a_j)``
               columns (token / position tables, patch      (as :func:`~symfuse.match.activation.
               projection: one shared input basis)          residual_permutation`, strategy ``all``)
heads (KV      the weight matcher's head cost (plain        ``-`` :func:`~symfuse.match.activation.
groups)        distance of q/k/v/o blocks; rotation- /      head_similarity`
               scale-invariant when those are asked too)
FFN neurons    ``-`` :func:`~symfuse.match.weights.         ``-corr`` of post-activation hidden units
               ffn_similarity`
=============  ===========================================  ============================================

Fusion is then the aligned source averaged with the anchor (any merge strategy). The per-module weight kinds
also run inside :func:`symfuse.match.weights.match_module_weights` (pipeline: models from one base, no residual
map); :func:`ot_align` does the whole model with the residual stream.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from symfuse.arch import Geometry, ModuleRef, get_spec
from symfuse.arch.spec import ArchSpec
from symfuse.errors import SymfuseError
from symfuse.match.closed_form import fit_rotation_scale
from symfuse.match.weights import attention_blocks, ffn_similarity, match_module_weights, module_distance
from symfuse.symmetry.residual import ResidualPermutation, permute_residual, residual_plan
from symfuse.symmetry.transforms import FFNPermutation, HeadPermutation, ModuleTransform, Transform
from symfuse.symmetry.transport import FFNTransport, HeadTransport, ResidualTransport, transport_residual

log = logging.getLogger(__name__)
SINKHORN_ITERS = 20000  # entropic OT's iterations at most

OT_KINDS = ("ot", "ot-soft", "ot-acts", "ot-acts-soft")
WEIGHT_OT_KINDS = ("ot", "ot-soft")
SOFT_REG = 0.05  # entropic regularisation of the *-soft kinds, relative to the cost range (rescaled to [0, 1])
Mode = Literal["weights", "acts"]


def kind_settings(kind: str) -> tuple[Mode, float]:
    """``(mode, reg)`` of an OT kind name (``ot`` -> weights / EMD, ``ot-acts-soft`` -> acts / Sinkhorn ...).

    Raises:
        ValueError: for a name not in :data:`OT_KINDS`.
    """
    if kind not in OT_KINDS:
        raise ValueError(f"unknown OT kind {kind!r}; accepted: {', '.join(OT_KINDS)}")
    return ("acts" if "acts" in kind else "weights"), (SOFT_REG if kind.endswith("soft") else 0.0)


def _pot():
    try:
        import ot
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise SymfuseError("OT fusion needs the `pot` package — install it: pip install pot==0.9.7.post1") from e
    return ot


def transport_plan(cost: torch.Tensor, reg: float = 0.0) -> torch.Tensor:
    """Optimal transport plan between uniform marginals for ``cost`` (n_source, n_anchor).

    Args:
        cost: Ground cost, any float dtype (rows: source units, columns: anchor units).
        reg: 0 for exact EMD; > 0 for entropic OT with that regularisation on the cost rescaled to [0, 1]
            (an affine rescaling does not change the EMD optimum under fixed marginals).

    Returns:
        ``T`` (n_source, n_anchor) float64: rows sum to ``1/n_source``, columns to ``1/n_anchor``.
    """
    import numpy as np

    ot = _pot()
    c = cost.detach().to(torch.float64).cpu()
    if not torch.isfinite(c).all():
        raise ValueError("transport cost holds NaN or inf")
    span = float(c.max() - c.min())
    c = (c - c.min()) / span if span > 0 else torch.zeros_like(c)
    n, m = c.shape
    a, b = np.full(n, 1.0 / n), np.full(m, 1.0 / m)
    if reg > 0:
        plan, info = ot.sinkhorn(
            a, b, c.numpy(), reg, method="sinkhorn_log", numItermax=SINKHORN_ITERS, stopThr=1e-9, log=True, warn=False
        )  # POT's warning named options no command has
        if info.get("niter", 0) >= SINKHORN_ITERS - 1:
            err = float(info["err"][-1]) if info.get("err") else float("nan")
            log.debug("Sinkhorn stopped at %d iterations above its tolerance (marginal error %.2g): the soft plan's "
                      "marginals are approximate", SINKHORN_ITERS, err)  # fmt: skip
    else:
        plan = ot.emd(a, b, c.numpy(), numItermax=max(100_000, 50 * n * m))
    return torch.as_tensor(np.asarray(plan), dtype=torch.float64)


def as_permutation(plan: torch.Tensor, tol: float = 1e-6) -> torch.Tensor | None:
    """``perm`` (anchor unit ``j`` takes source unit ``perm[j]``) if ``plan`` is a permutation matrix / n, else None."""
    n, m = plan.shape
    if n != m:
        return None
    perm = plan.argmax(dim=0)
    if torch.bincount(perm, minlength=n).max() != 1:
        return None
    if float(plan[perm, torch.arange(n)].min()) < (1 - tol) / n:
        return None
    return perm


def alignment_map(plan: torch.Tensor) -> torch.Tensor:
    """``M = n_anchor · T``: columns sum to 1 (anchor unit j = ``M[:, j]``-average of source units)."""
    return plan * plan.shape[1]


def _part(plan: torch.Tensor, exact: type[Transform], soft: type[Transform]) -> tuple[Transform, bool]:
    perm = as_permutation(plan)
    if perm is not None:
        return exact(perm), True  # type: ignore[call-arg]
    return soft(alignment_map(plan)), False  # type: ignore[call-arg]


# ------------------------------------------------------------------------------------------- weight costs
def head_cost(
    src: Mapping[str, torch.Tensor], anc: Mapping[str, torch.Tensor], geo: Geometry, rotate: bool, scale: bool
) -> torch.Tensor:
    """Cost (n_kv, n_kv) of source group ``i`` vs anchor group ``j``: the weight matcher's head-permutation cost.

    Residual of the q/k and v/o blocks after the optimal rotation / scale when asked (else the plain squared
    distance), minus the anchor norms (a per-column constant: the optimum is unchanged).
    """
    maps = {"qk": (rotate and not geo.qk_norm, scale and not geo.qk_norm), "vo": (rotate, scale)}
    sb, ab = attention_blocks(src, geo), attention_blocks(anc, geo)
    n = geo.n_kv_heads
    cost = torch.zeros(n, n, dtype=torch.float64)
    for name, a_role, b_role, use_rope in (("qk", "q", "k", geo.rope), ("vo", "v", "o", False)):
        ma = torch.einsum("jan,ibn->ijab", ab[a_role], sb[a_role])
        mb = torch.einsum("jan,ibn->ijab", ab[b_role], sb[b_role])
        na = (sb[a_role] ** 2).sum(-1)[:, None].expand(-1, n, -1)
        nb = (sb[b_role] ** 2).sum(-1)[:, None].expand(-1, n, -1)
        cost += fit_rotation_scale(ma, mb, na, nb, *maps[name], use_rope)[2]
    return cost


def residual_features(state: Mapping[str, torch.Tensor], spec: ArchSpec, config, prefix: str) -> torch.Tensor:
    """(d_model, F) float64: each stream coordinate described by the tensors that WRITE it from the inputs.

    Token / position / type embedding columns, ViT patch-projection rows, CLS and position parameters, or an
    ELECTRA embedding projection's rows. Their other axis is indexed by inputs (token ids, positions, pixels), the
    same in both models, so coordinates of two models compare directly (Singh & Jaggi's first layer).
    """
    names = set(state)
    projected = bool(spec.embedding_projection) and prefix + f"{spec.embedding_projection}.weight" in names
    paths = {prefix + spec.embedding_projection} if projected else {prefix + e for e in spec.embeddings}
    feats = []
    for name, action in sorted(residual_plan(spec, list(state), config, prefix).items()):
        if name not in paths and name.rpartition(".")[0] not in paths:
            continue
        t = state[name].detach().to(torch.float64)
        if action == "emb":
            action = "first" if t.ndim == 4 else "last"
        feats.append(t.reshape(-1, t.shape[-1]).T if action == "last" else t.reshape(t.shape[0], -1))
    if not feats:
        raise SymfuseError(f"{spec.family}: no stream embeddings found to compare residual coordinates by weights")
    return torch.cat(feats, dim=1)


def _sq_dist(f: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return (f * f).sum(1)[:, None] + (g * g).sum(1)[None, :] - 2 * f @ g.T


# ------------------------------------------------------------------------------------------- per module
def match_module_ot(
    ref: ModuleRef | str,
    src: Mapping[str, torch.Tensor],
    anc: Mapping[str, torch.Tensor],
    geo: Geometry,
    symmetries: Sequence[str] = ("ot",),
    fit_rotation_scaling: bool = True,
) -> ModuleTransform:
    """Weight-based OT alignment of ONE module (heads or FFN neurons; the residual stream is left alone).

    ``symmetries`` holds one of :data:`WEIGHT_OT_KINDS` and optionally ``rotation`` / ``scaling`` (fitted on the
    weights after the head transport unless ``fit_rotation_scaling`` is False; either way the head cost is then
    invariant to them). Exact permutations where the plan is one; soft maps otherwise (the module then computes a
    different function).
    """
    ref = ModuleRef.parse(ref) if isinstance(ref, str) else ref
    kinds = [s for s in symmetries if s in WEIGHT_OT_KINDS]
    if len(kinds) != 1 or {"ffn-permutation", "head-permutation"} & set(symmetries):
        raise ValueError(
            f"OT takes exactly one of {', '.join(WEIGHT_OT_KINDS)} (it replaces ffn-/head-permutation), "
            f"optionally with rotation / scaling; got {list(symmetries)}"
        )
    _, reg = kind_settings(kinds[0])
    rotate, scale = "rotation" in symmetries, "scaling" in symmetries
    if ref.kind == "ffn":
        part, _ = _part(transport_plan(-ffn_similarity(src, anc), reg), FFNPermutation, FFNTransport)
        return ModuleTransform(ref.key, (part,))
    t = ModuleTransform(ref.key, ())
    if geo.n_kv_heads > 1:
        part, _ = _part(transport_plan(head_cost(src, anc, geo, rotate, scale), reg), HeadPermutation, HeadTransport)
        t = ModuleTransform(ref.key, (part,))
    if (rotate or scale) and fit_rotation_scaling:
        extra = tuple(s for s in ("rotation", "scaling") if s in symmetries)
        t = ModuleTransform(ref.key, match_module_weights(ref, t.apply(src), anc, geo, extra).compose(t).parts)
    return t


def find_ot(
    src: Mapping[str, torch.Tensor],
    anc: Mapping[str, torch.Tensor],
    geo: Geometry,
    symmetries: Sequence[str],
    key: str,
    timings=None,
) -> ModuleTransform:
    """The ``ot`` / ``ot-soft`` kinds' finder (:mod:`symfuse.symmetry.registry`): :func:`match_module_ot`.

    Rotation and scaling, when asked for too, are fitted afterwards by their own finder on the transported weights
    (the registry chains the finders), so this returns the transport part only.
    """
    return match_module_ot(key, src, anc, geo, symmetries, fit_rotation_scaling=False)


# ------------------------------------------------------------------------------------------- whole model
def _unit_cost(mode: Mode, ref: ModuleRef, s, a, geo: Geometry, stats, rotate: bool, scale: bool) -> torch.Tensor:
    """Cost (source unit, anchor unit) of a module's FFN neurons or KV groups (see the module docstring)."""
    if mode == "acts" and ref.kind == "ffn":
        return -stats.sites[f"ffn.L{ref.layer:02d}"].correlation().T  # correlation is [A, B]
    if mode == "acts":
        from symfuse.match.activation import head_similarity

        return -head_similarity(stats, ref.layer, geo.n_heads, geo.n_kv_heads)
    if ref.kind == "ffn":
        return -ffn_similarity(s, a)
    return head_cost(s, a, geo, rotate, scale)


@dataclass
class OTMatch:
    """Result of :func:`ot_align`.

    Attributes:
        residual: The residual part applied first (``ResidualPermutation`` or ``ResidualTransport``; None if off).
        modules: Per-module transforms applied after it.
        state: The aligned source's tensors (same names as the source ``state_dict``).
        exact: True when every plan was a permutation (then ``state`` computes the source's function).
        per_module: Distances to the anchor before / after and whether the module's plan was exact.
    """

    residual: Transform | None
    modules: dict[str, ModuleTransform]
    state: dict[str, torch.Tensor]
    exact: bool
    residual_exact: bool = True
    per_module: list[dict] = field(default_factory=list)

    def module_transforms(self) -> dict[str, ModuleTransform]:
        """Per-module transforms with the residual part first (for saving), plus ``residual`` on its own."""

        def lead() -> tuple:  # a fresh tensor per module: safetensors refuses shared storage
            if self.residual is None:
                return ()
            return (type(self.residual).from_tensors({k: v.clone() for k, v in self.residual.tensors().items()}),)

        out = {k: ModuleTransform(k, (*lead(), *t.parts)) for k, t in self.modules.items()}
        if self.residual is not None:
            out["residual"] = ModuleTransform("residual", lead())
        return out


def check_pair(source: torch.nn.Module, anchor: torch.nn.Module) -> tuple[ArchSpec, Geometry]:
    """Spec and geometry of two models of ONE family and shape.

    Raises:
        SymfuseError: one line naming both families or both shapes.
    """
    spec, other = get_spec(source.config), get_spec(anchor.config)
    if spec.family != other.family:
        raise SymfuseError(
            f"OT alignment needs two models of one family: source is {spec.family}, anchor is {other.family}"
        )
    geo, geo_a = spec.geometry(source.config), other.geometry(anchor.config)
    if geo != geo_a:
        raise SymfuseError(f"OT alignment needs equal shapes: source {geo} vs anchor {geo_a}")
    return spec, geo


def ot_align(
    source: torch.nn.Module,
    anchor: torch.nn.Module,
    mode: Mode = "weights",
    reg: float = 0.0,
    batches: Iterable[Mapping[str, torch.Tensor]] | None = None,
    symmetries: Sequence[str] = (),
    residual: bool = True,
    stats=None,
    device: str = "cpu",
) -> OTMatch:
    """Align SOURCE to ANCHOR by optimal transport through the residual stream, heads and FFN neurons.

    Args:
        source: Model to align (not modified).
        anchor: Model to align it to (same family and shapes; not modified).
        mode: ``weights`` (costs from the weights) or ``acts`` (acts-EMD: costs from paired activations).
        reg: 0: exact EMD (reduces to the permutation matchers' result); > 0: entropic, soft (not exact).
        batches: Inputs for the activation statistics (``acts`` only; ignored when ``stats`` is given).
        symmetries: Extra exact weight-based maps fitted per head after the transport: ``rotation``, ``scaling``.
        residual: Align the residual stream (Imfeld et al.); False keeps it (models sharing one base).
        stats: Precomputed :func:`symfuse.stats.activations.collect_activation_stats` (A = anchor, B = source).
        device: Where the statistics pass runs.

    Returns:
        :class:`OTMatch`; ``result.exact`` tells whether the aligned source still computes SOURCE's function.

    Raises:
        SymfuseError: different families or shapes; ValueError: bad ``mode`` / ``symmetries`` / missing batches.
    """
    spec, geo = check_pair(source, anchor)
    stats = _checked_stats(mode, symmetries, source, anchor, batches, stats, device)
    src_state = {k: v.detach().cpu() for k, v in source.state_dict().items()}
    anc_state = {k: v.detach().cpu() for k, v in anchor.state_dict().items()}
    prefix = spec.detect_prefix(src_state)
    state, res_part, exact = dict(src_state), None, True
    if residual:
        state, res_part, exact = _align_residual(src_state, anc_state, spec, source.config, prefix, mode, reg, stats)
    res_exact = exact
    modules, report = {}, []
    for ref in spec.modules(source.config):
        a = spec.read_module(anc_state.__getitem__, anc_state.__contains__, ref, anchor.config, prefix)
        now = spec.read_module(state.__getitem__, state.__contains__, ref, source.config, prefix)
        t, moved, ok = _align_module(ref, now, a, geo, mode, reg, stats, symmetries)
        modules[ref.key] = t
        state.update(spec.write_module(moved, ref, source.config, prefix))
        exact = exact and ok
        s = spec.read_module(src_state.__getitem__, src_state.__contains__, ref, source.config, prefix)
        report.append(
            {"module": ref.key, "kind": ref.kind, "before": module_distance(s, a), "after": module_distance(moved, a),
             "exact": ok}
        )  # fmt: skip
    if not exact:
        log.info("OT alignment (%s, reg %g): soft plans — the aligned source is NOT function-preserving", mode, reg)
    return OTMatch(res_part, modules, state, exact, res_exact, report)


def _checked_stats(mode: str, symmetries: Sequence[str], source, anchor, batches, stats, device: str):
    """``mode`` and ``symmetries`` checked; the activation statistics ``acts`` needs (collected when not given).

    Raises:
        ValueError: bad ``mode`` / ``symmetries``, or ``acts`` without batches or statistics.
    """
    if mode not in ("weights", "acts"):
        raise ValueError(f"unknown OT mode {mode!r}; accepted: weights, acts")
    bad = [s for s in symmetries if s not in ("rotation", "scaling")]
    if bad:
        raise ValueError(f"OT alignment takes only rotation / scaling as extra symmetries, got {bad}")
    if mode == "acts" and stats is None:
        if batches is None:
            raise ValueError("activation-based OT needs `batches` (or precomputed `stats`)")
        from symfuse.stats.activations import collect_activation_stats

        stats = collect_activation_stats(anchor, source, batches, device=device)
    return stats


def _align_residual(
    src_state: dict, anc_state: dict, spec: ArchSpec, cfg, prefix: str, mode: str, reg: float, stats
) -> tuple[dict, Transform, bool]:
    """The source's state with its residual stream transported onto the anchor's: ``(state, part, exact)``."""
    if mode == "acts":
        cost = -sum(stats.sites[s].correlation() for s in stats.residual_sites()).T  # corr is [A, B]
    else:
        f_src, f_anc = (residual_features(st, spec, cfg, prefix) for st in (src_state, anc_state))
        cost = _sq_dist(f_src, f_anc)
    part, exact = _part(transport_plan(cost, reg), ResidualPermutation, ResidualTransport)
    if exact:
        return permute_residual(src_state, spec, cfg, part.perm, prefix), part, True  # type: ignore[attr-defined]
    return transport_residual(src_state, spec, cfg, part.map, prefix), part, False  # type: ignore[attr-defined]


def _align_module(
    ref: ModuleRef, s: Any, a: Any, geo: Geometry, mode: str, reg: float, stats, symmetries: Sequence[str]
) -> tuple[ModuleTransform, Any, bool]:
    """Module ``s`` (the source's, after the residual map) transported onto the anchor's ``a``.

    FFN units, and heads when there are several KV heads, by a transport plan; then, for attention, the extra
    per-head ``rotation`` / ``scaling`` fitted to the weights. Returns ``(transform, moved module, exact)``.
    """
    rotate, scale = "rotation" in symmetries, "scaling" in symmetries
    parts: list[Transform] = []
    ok = True
    if ref.kind == "ffn" or geo.n_kv_heads > 1:
        cost = _unit_cost(mode, ref, s, a, geo, stats, rotate, scale)
        kinds = (FFNPermutation, FFNTransport) if ref.kind == "ffn" else (HeadPermutation, HeadTransport)
        part, ok = _part(transport_plan(cost, reg), *kinds)
        parts.append(part)
    t = ModuleTransform(ref.key, tuple(parts))
    moved = t.apply(s)
    if ref.kind == "attn" and (rotate or scale):
        extra = tuple(x for x in ("rotation", "scaling") if x in symmetries)
        t = ModuleTransform(ref.key, match_module_weights(ref, moved, a, geo, extra).compose(t).parts)
        moved = t.apply(s)
    return t, moved, ok
