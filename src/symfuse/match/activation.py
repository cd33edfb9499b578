"""Activation-based matching: permutations found from paired activation statistics (all exact).

Given :class:`symfuse.stats.activations.ActivationStats` of ANCHOR (``a``) and SOURCE (``b``) on the same inputs:

* residual stream: ONE permutation of d_model from the correlation of the norm outputs — strategy ``first``
  (the first site: embedding norm, or the first layer's first norm for pre-LN models), ``last`` (the last site:
  final norm, or the last layer's second norm) or ``all`` (correlations summed over every site). Each gives one
  global permutation, which is exact for every supported family (see :mod:`symfuse.symmetry.residual`:
  different permutations per sublayer are never exact with an identity skip path, so they are not offered);
* FFN neurons per layer: Hungarian on ``corr(b_i, a_j)`` of the hidden activations after the nonlinearity;
* heads (KV groups with their query heads) per layer: Hungarian on a rotation-invariant head similarity, the
  nuclear norm of the head pair's cross-covariance block ``||Cov(b_h, a_h')||_*`` normalised by
  ``sqrt(tr Σ_b_h · tr Σ_a_h')`` (heads move as whole units; summed over a group's query heads under GQA).

A family with several residual streams (CLIP's two towers) gets one such permutation per stream, each from its own
stream's sites; stacks sharing a stream (T5's encoder, decoder and cross-attention) share its permutation.

The statistics of FFN activations and head outputs do not depend on the residual permutation (every reader of the
stream is permuted with it), so one statistics pass serves all three. Rotation and scaling inside each head are
then found from the WEIGHTS (:func:`symfuse.match.weights.match_module_weights`) on the permuted source.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from symfuse.arch import Geometry, ModuleRef, get_spec
from symfuse.checkpoint import load_hf_model
from symfuse.match.closed_form import assign_max
from symfuse.match.publish import AlignRequest, Found, publish_alignment, whole_model_mode
from symfuse.match.weights import match_module_weights, module_distance, state_sq_distance
from symfuse.stats.activations import ActivationStats, collect_activation_stats, module_site
from symfuse.symmetry.registry import SYMMETRY_KINDS, check_kinds, compatible_kinds, kind_names, kinds_for
from symfuse.symmetry.residual import ResidualPermutation, permute_residual
from symfuse.symmetry.transforms import FFNPermutation, HeadPermutation, ModuleTransform, Transform

log = logging.getLogger(__name__)

# the EXACT kinds `match --data` takes that were registered at import and go together (the registry is read again at
# every call; the inexact ones, e.g. OT's soft alignment, and head-linear are in kind_names("activations") too)
ACTIVATION_SYMMETRIES = compatible_kinds(n for n in kind_names("activations") if SYMMETRY_KINDS[n].exact)
ResidualStrategy = Literal["first", "last", "all"]
RANDOM_PIXELS = "random-pixels"  # --data for pixel families: statistics from seeded random pixel inputs


def residual_permutation(stats: ActivationStats, strategy: ResidualStrategy = "all", stream: str = "") -> torch.Tensor:
    """The residual permutation aligning B's stream to A's (new coordinate j = old ``perm[j]``).

    Args:
        stats: Paired statistics with A = anchor, B = source.
        strategy: ``first``, ``last`` or ``all`` (see the module docstring).
        stream: Which residual stream (``ArchSpec.streams``; ``""`` for single-stream families).

    Returns:
        ``perm`` (d_model,) int64.
    """
    sites = stats.residual_sites(stream)
    if not sites:
        raise ValueError("no residual-stream sites in the activation statistics")
    chosen = {"first": sites[:1], "last": sites[-1:], "all": sites}.get(strategy)
    if chosen is None:
        raise ValueError(f"unknown residual strategy {strategy!r}; accepted: first, last, all")
    corr = sum(stats.sites[s].correlation() for s in chosen)  # (d, d): [i (A), j (B)]
    perm, _ = assign_max(corr.T.contiguous())  # rows: source (B), columns: anchor (A)
    return perm


def _site(kind: str, layer: int | ModuleRef) -> str:
    return module_site(kind, layer) if isinstance(layer, ModuleRef) else f"{kind}.L{layer:02d}"


def ffn_permutation(stats: ActivationStats, layer: int | ModuleRef) -> torch.Tensor:
    """Neuron permutation of layer ``layer`` (index, or a stack's FFN module) from activation correlation."""
    corr = stats.sites[_site("ffn", layer)].correlation()  # (d_ffn, d_ffn): [A, B]
    perm, _ = assign_max(corr.T.contiguous())
    return perm


def head_similarity(stats: ActivationStats, layer: int | ModuleRef, n_heads: int, n_kv_heads: int) -> torch.Tensor:
    """Similarity of source group ``i`` and anchor group ``j`` (n_kv, n_kv), invariant to rotations inside heads.

    ``layer``: a layer index, or the attention module of a stack.
    """
    m = stats.sites[_site("heads", layer)]
    cov = m.cross_covariance()  # (H*dh, H*dh): [A, B]
    va, vb = m.var_a(), m.var_b()
    dh = cov.shape[0] // n_heads
    blocks = cov.reshape(n_heads, dh, n_heads, dh).permute(2, 0, 1, 3)  # [h_B, h_A, dh, dh]
    nuc = torch.linalg.matrix_norm(blocks, ord="nuc")  # (H_B, H_A)
    ta, tb = va.reshape(n_heads, dh).sum(1), vb.reshape(n_heads, dh).sum(1)
    sim = nuc / (torch.outer(tb, ta).sqrt() + 1e-12)
    g = n_heads // n_kv_heads  # query head r of group i pairs with query head r of group j
    return sim.reshape(n_kv_heads, g, n_kv_heads, g).diagonal(dim1=1, dim2=3).sum(-1)


def head_permutation(stats: ActivationStats, layer: int | ModuleRef, n_heads: int, n_kv_heads: int) -> torch.Tensor:
    """KV-group permutation of layer ``layer`` (query heads move with their group) from head similarity."""
    perm, _ = assign_max(head_similarity(stats, layer, n_heads, n_kv_heads))
    return perm


def find_ffn_permutation(stats: ActivationStats, ref: ModuleRef, geo: Geometry) -> tuple[Transform, ...]:
    """The ``ffn-permutation`` kind's activation finder."""
    return (FFNPermutation(ffn_permutation(stats, ref)),)


def find_head_permutation(stats: ActivationStats, ref: ModuleRef, geo: Geometry) -> tuple[Transform, ...]:
    """The ``head-permutation`` kind's activation finder (``geo``: the module's stack).

    Nothing to permute with one KV group, nor where one per-head bias table is shared by every layer of the stack
    (T5 self-attention: permuting one layer's heads would not be exact).
    """
    geo = geo.of(ref.stack)
    if geo.n_kv_heads <= 1 or geo.shared_head_bias:
        return ()
    return (HeadPermutation(head_permutation(stats, ref, geo.n_heads, geo.n_kv_heads)),)


@dataclass
class ActivationMatch:
    """Result of :func:`match_activations`.

    Attributes:
        residual: The residual permutation applied first (None when not requested; for a family with several
            residual streams, the one of stream ``""`` if any — see ``residuals``).
        modules: Per-module transforms applied after it (head / FFN permutations, then rotation and scaling).
        state: The matched source's tensors (same names as the source ``state_dict``).
        per_module: Distances to the anchor before / after, per module.
        residuals: The residual permutation of every stream (``{stream: permutation}``; empty when not requested).
        stream_of: The stream of each module key (which residual permutation leads its transform).
    """

    residual: ResidualPermutation | None
    modules: dict[str, ModuleTransform]
    state: dict[str, torch.Tensor]
    per_module: list[dict] = field(default_factory=list)
    residuals: dict[str, ResidualPermutation] = field(default_factory=dict)
    stream_of: dict[str, str] = field(default_factory=dict)

    def module_transforms(self) -> dict[str, ModuleTransform]:
        """Per-module transforms including the module part of the residual permutation (for saving)."""

        def lead(key: str) -> tuple:  # a fresh tensor per module: safetensors refuses shared storage
            r = self.residuals.get(self.stream_of.get(key, ""), self.residual)
            return (ResidualPermutation(r.perm.clone()),) if r is not None else ()

        return {k: ModuleTransform(k, (*lead(k), *t.parts)) for k, t in self.modules.items()}


def match_activations(
    source: torch.nn.Module,
    anchor: torch.nn.Module,
    batches: Iterable[Mapping[str, torch.Tensor]] | None = None,
    symmetries: Sequence[str] = ACTIVATION_SYMMETRIES,
    residual_strategy: ResidualStrategy = "all",
    stats: ActivationStats | None = None,
    device: str = "cpu",
) -> ActivationMatch:
    """Align SOURCE to ANCHOR: permutations from activations, then weight-based rotation and scaling.

    Args:
        source: Model to align (not modified).
        anchor: Model to align it to (same family and shapes; not modified).
        batches: Inputs for the statistics (ignored when ``stats`` is given).
        symmetries: Registered kinds found from activations or weights (see :data:`ACTIVATION_SYMMETRIES`).
        residual_strategy: ``first``, ``last`` or ``all``.
        stats: Precomputed :func:`collect_activation_stats` with A = anchor, B = source.
        device: Where the statistics pass runs.

    Returns:
        :class:`ActivationMatch`; load ``result.state`` into a copy of ``source`` to get the matched model, which
        computes exactly the same function as ``source``.
    """
    check_kinds(symmetries, "activations")
    spec = get_spec(source.config)
    geo = spec.geometry(source.config)
    needs_stats = [n for n in symmetries if SYMMETRY_KINDS[n].activations is not None]
    if needs_stats and stats is None:
        if batches is None:
            raise ValueError("activation matching needs `batches` (or precomputed `stats`)")
        stats = collect_activation_stats(anchor, source, batches, device=device)
    src_state = {k: v.detach().cpu() for k, v in source.state_dict().items()}
    anc_state = {k: v.detach().cpu() for k, v in anchor.state_dict().items()}
    prefix = spec.detect_prefix(src_state)
    residuals: dict[str, ResidualPermutation] = {}
    state = dict(src_state)  # a new mapping: the report's "before" distances read the untouched source
    for kind in kinds_for(symmetries, "residual", "activations"):  # one permutation per residual stream (CLIP: two)
        streams = spec.streams(source.config)
        find = kind.fn("activations")
        residuals = {s: ResidualPermutation(find(stats, residual_strategy, s)) for s in streams}
        perms = {s: r.perm for s, r in residuals.items()}
        state = permute_residual(src_state, spec, source.config, perms, prefix)
    modules, report = {}, []
    for ref in spec.modules(source.config):
        g = geo.of(ref.stack)
        s = spec.read_module(state.__getitem__, state.__contains__, ref, source.config, prefix)
        a = spec.read_module(anc_state.__getitem__, anc_state.__contains__, ref, anchor.config, prefix)
        parts: list[Transform] = []
        kinds = kinds_for(symmetries, ref.kind, "activations")
        for kind in kinds:  # permutations from the statistics first (on the module's own stack's geometry)
            if kind.activations is not None:
                parts += kind.fn("activations")(stats, ref, g)
        t = ModuleTransform(ref.key, tuple(parts))
        moved = t.apply(s)
        weight_syms = tuple(k.name for k in kinds if k.activations is None)  # then the rest from the weights
        if weight_syms:
            t = match_module_weights(ref, moved, a, geo, weight_syms).compose(t)
            t = ModuleTransform(ref.key, t.parts)
            moved = t.apply(s)
        modules[ref.key] = t
        state.update(spec.write_module(moved, ref, source.config, prefix))
        before = module_distance(
            spec.read_module(src_state.__getitem__, src_state.__contains__, ref, source.config, prefix), a
        )
        report.append({"module": ref.key, "kind": ref.kind, "before": before, "after": module_distance(moved, a)})
    stream_of = {ref.key: spec.stack(ref.stack).stream for ref in spec.modules(source.config)}
    return ActivationMatch(residuals.get(""), modules, state, report, residuals, stream_of)


def matched_model(source: torch.nn.Module, result: ActivationMatch) -> torch.nn.Module:
    """A NEW module: a deep copy of ``source`` holding ``result.state``."""
    import copy

    new = copy.deepcopy(source)
    new.load_state_dict(result.state)
    return new.eval()


def _load_model(path: Path) -> torch.nn.Module:
    return load_hf_model(path, dtype=torch.float32)


def tied_names(state: Mapping[str, torch.Tensor]) -> frozenset:
    """Names of a model's ``state_dict()`` that alias a tensor listed before them (a tied LM head: one tensor)."""
    first: dict[tuple[int, tuple], str] = {}
    for name, t in state.items():
        first.setdefault((t.data_ptr(), tuple(t.shape)), name)
    return frozenset(n for n, t in state.items() if first[(t.data_ptr(), tuple(t.shape))] != n)


def _logit_diff_in_memory(a: torch.nn.Module, b: torch.nn.Module, seed: int = 0) -> float:
    """Max |Δ| of the outputs (logits, else last hidden state) on random inputs of the family's kind, fp32."""
    inputs = get_spec(a.config).random_inputs(a.config, generator=torch.Generator().manual_seed(seed))
    spec = get_spec(a.config)
    with torch.no_grad():
        oa, ob = a(**inputs), b(**inputs)
    return float((spec.main_output(oa) - spec.main_output(ob)).abs().max())


def pixel_batches(config: Any, n_examples: int, batch_size: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Seeded standard-normal ``pixel_values`` batches for a pixel family (see ``ArchSpec.inputs``).

    A family reading tokens too (CLIP) gets random tokens alongside.
    """
    spec, g = get_spec(config), torch.Generator().manual_seed(seed)
    sizes = [min(batch_size, n_examples - i) for i in range(0, n_examples, batch_size)]
    return [spec.random_inputs(config, batch=b, generator=g) for b in sizes]


def match_activation_checkpoints(
    source: str | Path,
    anchor: str | Path,
    out: str | Path,
    data: str,
    symmetries: Sequence[str] = ACTIVATION_SYMMETRIES,
    max_examples: int | None = 512,
    residual_strategy: ResidualStrategy = "all",
    batch_size: int = 16,
    max_length: int = 128,
    device: str = "cpu",
    overwrite: bool = False,
    verify: str = "full",
) -> dict:
    """The ``activations`` alignment (``symfuse match --data``), written like every alignment.

    Args:
        source: Source checkpoint folder (or ``"minilm"`` / hub id).
        anchor: Anchor checkpoint of the same family and shapes.
        out: Output folder (must not exist; written atomically): the matched checkpoint (SOURCE's tensor names),
            ``transforms.safetensors`` (per-module transforms with the residual part first, plus ``residual``)
            and ``symfuse_report.json``.
        data: Dataset whose training texts feed both models (any :func:`symfuse.data.load_task_dataset` source);
            for pixel families (``ArchSpec.inputs``: ViT, CLIP) :data:`RANDOM_PIXELS`, seeded random images (and
            random tokens for CLIP).
        symmetries: Registered kinds found from activations or weights (see :data:`ACTIVATION_SYMMETRIES`).
        max_examples: Examples used for the statistics.
        residual_strategy: ``first``, ``last`` or ``all``.
        batch_size: Examples per forward pass.
        max_length: Truncation length in tokens.
        device: Where the models run.
        overwrite: Replace an existing ``out`` (atomically, at the end).
        verify: ``none`` skips the check of the written folder (any other mode loads both models whole).

    Returns:
        The report (:func:`symfuse.match.report.alignment_report`; the driver adds ``mode``, ``data``,
        ``max_examples``, ``residual_strategy``, ``per_module``).
    """
    options = {"residual_strategy": residual_strategy, "batch_size": batch_size, "max_length": max_length}
    request = AlignRequest(source, anchor, Path(out), tuple(symmetries), data, max_examples, verify=verify,
                           device=device, overwrite=overwrite, options=options)  # fmt: skip
    return publish_alignment(request, "activations", activation_step)


def _paired_models(src_path: Path, anc_path: Path, spec: Any, request: AlignRequest) -> tuple:
    """Both models (float32) and the batches feeding them: ``request.data``'s texts, or random pixels."""
    from symfuse.data import make_batches
    from symfuse.io import check_tokenizer

    data, max_examples = request.data, request.max_examples
    batch_size, max_length = request.option("batch_size", 16), request.option("max_length", 128)
    if "pixels" in spec.inputs:  # no image datasets yet: seeded random pixels, only when asked for by name
        if data != RANDOM_PIXELS:
            raise ValueError(
                f"{src_path}: a {spec.family} model reads pixels and symfuse has no image datasets; "
                f"pass --data {RANDOM_PIXELS} (statistics from seeded random pixel inputs)"
            )
        src_model, anc_model = _load_model(src_path), _load_model(anc_path)
        return src_model, anc_model, pixel_batches(src_model.config, max_examples or 512, batch_size)
    check_tokenizer(src_path)  # the source's tokenizer encodes the texts: refuse a folder without one up front
    src_model, anc_model = _load_model(src_path), _load_model(anc_path)
    batches = make_batches(data, src_path, "train", batch_size, max_length, max_examples)
    batches = [{k: v for k, v in b.items() if k in ("input_ids", "attention_mask")} for b in batches]
    if "decoder_tokens" in spec.inputs:  # encoder-decoder (T5): the decoder reads the same text
        batches = [{**b, "decoder_input_ids": b["input_ids"]} for b in batches]
    return src_model, anc_model, batches


def activation_step(request: AlignRequest, tmp: Path) -> Found:
    """The ``activations`` driver's step (:data:`symfuse.match.publish.Step`): permutations from activations."""
    from symfuse.checkpoint import CheckpointReader, resolve_checkpoint
    from symfuse.match.inputs import TRANSFORMS_FILE, check_compatible
    from symfuse.match.verify import is_exact
    from symfuse.match.written import stored_dtype, write_model
    from symfuse.symmetry.transforms import save_transforms

    src_path, anc_path = resolve_checkpoint(request.source), resolve_checkpoint(request.anchor)
    with CheckpointReader(src_path) as src, CheckpointReader(anc_path) as anc:
        check_compatible(src, anc)
        spec = src.spec
    src_model, anc_model, batches = _paired_models(src_path, anc_path, spec, request)
    strategy = request.option("residual_strategy", "all")
    result = match_activations(src_model, anc_model, batches, request.kinds, strategy, device=request.device)
    transforms = result.module_transforms()
    for stream, r in result.residuals.items():  # "residual", or "residual.<stream>" per stream (CLIP)
        key = f"residual.{stream}" if stream else "residual"
        transforms[key] = ModuleTransform(key, (ResidualPermutation(r.perm.clone()),))
    write_model(matched_model(src_model, result), src_path, tmp)
    save_transforms(transforms, tmp / TRANSFORMS_FILE)
    src_state, anc_state = src_model.state_dict(), anc_model.state_dict()
    tied = tied_names(src_state) | tied_names(anc_state)  # a tied head counted once
    extra = {"mode": "activation", "data": request.data, "max_examples": request.max_examples,
             "residual_strategy": strategy, "per_module": result.per_module}  # fmt: skip
    return Found(
        str(src_path), str(anc_path), spec.family, list(request.kinds),
        exact=all(is_exact(t) for t in transforms.values()),
        distance_before=state_sq_distance(src_state, anc_state, tied) ** 0.5,
        distance_after=state_sq_distance(result.state, anc_state, tied) ** 0.5, dtype=stored_dtype(src_path),
        device=str(request.device), verify=whole_model_mode(request.verify), extra=extra,
    )  # fmt: skip
