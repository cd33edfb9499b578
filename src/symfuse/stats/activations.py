"""Paired activation statistics of two models run on the same inputs (streaming, float64).

For every *site* both models are hooked at the same place and, token by token (padding excluded), the
running sums ``Σa``, ``Σb``, ``Σa²``, ``Σb²`` and ``Σ a bᵀ`` are accumulated in float64, so N can be large and
memory is O(sites · width²). Sites (keys):

* ``resid.emb`` / ``resid.L03.attn`` / ``resid.L03.ffn`` / ``resid.final``: outputs of every norm on the residual
  stream (embedding norm, the two per-layer norms, final norm), shape (d_model,);
* ``ffn.L03``: FFN hidden activation after the nonlinearity (the input of the down projection; for gated FFNs
  ``act(gate x) * up x``), shape (d_ffn,);
* ``heads.L03``: per-head attention outputs before the output projection (the input of ``o``), shape
  (n_heads * head_dim,), head ``h`` = features ``h*dh:(h+1)*dh``.

Multi-stack families (T5, CLIP; see :mod:`symfuse.arch.layout`) name the stack in every layer site
(``resid.enc.L03.attn``, ``ffn.dec.L03``, ``heads.cross.L01``, ``resid.vision.emb``, ``resid.text.final``) and
keep the residual sites of each residual stream apart (:meth:`ActivationStats.residual_sites`): a stream is
permuted as a whole, and two streams (CLIP's towers) are permuted independently.

Module locations come from the family spec (:class:`symfuse.arch.ArchSpec`); no names are hard-coded here.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from symfuse.arch import ArchSpec, ModuleRef, get_spec
from symfuse.device import resolve_device

log = logging.getLogger(__name__)


@dataclass
class PairedMoments:
    """Streaming first and second moments of paired features ``a`` (p,) and ``b`` (q,) in float64."""

    n: int = 0
    sum_a: torch.Tensor | None = None  # (p,)
    sum_b: torch.Tensor | None = None  # (q,)
    sq_a: torch.Tensor | None = None  # (p,)
    sq_b: torch.Tensor | None = None  # (q,)
    cross: torch.Tensor | None = None  # (p, q)  Σ a bᵀ

    def update(self, a: torch.Tensor, b: torch.Tensor) -> None:
        """Add ``a`` (n, p) and ``b`` (n, q) (row t of both = the same token)."""
        a, b = a.detach().to("cpu", torch.float64), b.detach().to("cpu", torch.float64)
        if self.cross is None:
            p, q = a.shape[1], b.shape[1]
            z = torch.zeros
            self.sum_a, self.sum_b = z(p, dtype=torch.float64), z(q, dtype=torch.float64)
            self.sq_a, self.sq_b = z(p, dtype=torch.float64), z(q, dtype=torch.float64)
            self.cross = z(p, q, dtype=torch.float64)
        self.n += a.shape[0]
        self.sum_a += a.sum(0)
        self.sum_b += b.sum(0)
        self.sq_a += (a * a).sum(0)
        self.sq_b += (b * b).sum(0)
        self.cross += a.T @ b

    def _check(self) -> None:
        if self.cross is None or self.n < 2:
            raise ValueError("activation statistics hold fewer than 2 tokens; give more (or non-padding) inputs")

    def var_a(self) -> torch.Tensor:
        """Per-feature variance of ``a`` (p,)."""
        self._check()
        return (self.sq_a / self.n - (self.sum_a / self.n) ** 2).clamp_min(0)

    def var_b(self) -> torch.Tensor:
        """Per-feature variance of ``b`` (q,)."""
        self._check()
        return (self.sq_b / self.n - (self.sum_b / self.n) ** 2).clamp_min(0)

    def cross_covariance(self) -> torch.Tensor:
        """``Cov(a, b)`` (p, q)."""
        self._check()
        return self.cross / self.n - torch.outer(self.sum_a / self.n, self.sum_b / self.n)

    def correlation(self, eps: float = 1e-12) -> torch.Tensor:
        """Pearson correlation ``corr(a_i, b_j)`` (p, q); constant features correlate 0."""
        sa, sb = self.var_a().sqrt(), self.var_b().sqrt()
        return self.cross_covariance() / (torch.outer(sa, sb) + eps)


@dataclass
class ActivationStats:
    """Paired statistics of model A (``a``) and model B (``b``) by site (see the module docstring)."""

    sites: dict[str, PairedMoments] = field(default_factory=dict)
    n_layers: int = 0
    streams: dict[str, list[str]] = field(default_factory=dict)  # residual sites of each stream, forward order

    def residual_sites(self, stream: str = "") -> list[str]:
        """Residual-stream sites of one stream (``""``: the only stream of most families) in forward order."""
        if self.streams:
            order = self.streams.get(stream, [])
        else:
            layers = [f"resid.L{i:02d}.{k}" for i in range(self.n_layers) for k in ("attn", "ffn")]
            order = ["resid.emb", *layers, "resid.final"]
        return [s for s in order if s in self.sites]


def module_site(kind: str, ref: ModuleRef) -> str:
    """The site of a module's inner activation: ``heads.L03`` / ``ffn.L03`` (``heads.enc.L03`` in a stack)."""
    return f"{kind}.{ref.key.rpartition('.')[0]}"


def _norm_sites(spec: ArchSpec, config: Any, prefix: str, names: Iterable[str] = ()) -> dict[str, tuple[str, str]]:
    """``{site: (module path, stream)}`` for every norm output on a residual stream, in forward order.

    With an embedding projection among ``names`` (ELECTRA: the embedding norm is not in the stream), the
    embedding site is the projection's output.
    """
    out: dict[str, tuple[str, str]] = {}
    proj = prefix + spec.embedding_projection if spec.embedding_projection else None
    if proj is not None and proj + ".weight" in set(names):
        out["resid.emb"] = (proj, "")
    elif spec.embedding_norm:
        out["resid.emb"] = (prefix + spec.embedding_norm, "")
    geo = spec.geometry(config)
    for st in spec.all_stacks():
        tag = f"{st.name}." if st.name else ""
        if st.embedding_norm:
            out[f"resid.{tag}emb"] = (prefix + st.embedding_norm, st.stream)
        for i in range(geo.of(st.name).n_layers):
            for sub, path in spec.norm_paths(i, prefix, st.name).items():
                out[f"resid.{tag}L{i:02d}.{sub}"] = (path, st.stream)
        if st.final_norm:
            out[f"resid.{tag}final"] = (prefix + st.final_norm, st.stream)
    if spec.final_norm:
        out["resid.final"] = (prefix + spec.final_norm, "")
    return out


def _hook_model(model: torch.nn.Module, store: dict[str, torch.Tensor]) -> list:
    spec = get_spec(model.config)
    prefix = spec.detect_prefix(model.state_dict().keys())
    handles = []

    def out_hook(site: str):
        def hook(_m, _inp, out):
            store[site] = out[0] if isinstance(out, tuple) else out

        return hook

    def in_hook(site: str):
        def hook(_m, inp):
            store[site] = inp[0]

        return hook

    for site, (path, _) in _norm_sites(spec, model.config, prefix, model.state_dict().keys()).items():
        handles.append(model.get_submodule(path).register_forward_hook(out_hook(site)))
    for ref in spec.modules(model.config):
        path = spec.module_paths(ref, model.config, prefix)["o" if ref.kind == "attn" else "down"]
        site = module_site("heads" if ref.kind == "attn" else "ffn", ref)
        handles.append(model.get_submodule(path).register_forward_pre_hook(in_hook(site)))
    return handles


def _tokens(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """(batch, seq, f) -> (tokens, f) keeping non-padding tokens."""
    if x.dim() == 2:
        return x
    if mask is not None and mask.shape == x.shape[:2]:
        return x[mask.bool()]
    return x.reshape(-1, x.shape[-1])


def collect_activation_stats(
    model_a: torch.nn.Module,
    model_b: torch.nn.Module,
    batches: Iterable[Mapping[str, torch.Tensor]],
    device: str = "cpu",
    stats: ActivationStats | None = None,
) -> ActivationStats:
    """Run both models on the same batches and accumulate paired statistics at every site.

    Args:
        model_a: Model A (e.g. the anchor). Not modified (hooks are removed afterwards).
        model_b: Model B (e.g. the source), same family and shapes.
        batches: Model inputs (``input_ids`` + ``attention_mask``, or ``pixel_values``); padding tokens
            (``attention_mask == 0``) are left out.
        device: Where to run (falls back to CPU when CUDA is absent).
        stats: Statistics to continue accumulating into (streaming over several calls).

    Returns:
        The :class:`ActivationStats` (float64, on CPU).
    """
    dev = resolve_device(device)
    geo_a = get_spec(model_a.config).geometry(model_a.config)
    geo_b = get_spec(model_b.config).geometry(model_b.config)
    if geo_a != geo_b:
        raise ValueError(f"models differ in shape: {geo_a} vs {geo_b}")
    if stats is None:
        spec = get_spec(model_a.config)
        names = model_a.state_dict().keys()
        streams: dict[str, list[str]] = {}
        for site, (_, stream) in _norm_sites(spec, model_a.config, spec.detect_prefix(names), names).items():
            streams.setdefault(stream, []).append(site)
        stats = ActivationStats(n_layers=geo_a.n_layers, streams=streams)
    store_a: dict[str, torch.Tensor] = {}
    store_b: dict[str, torch.Tensor] = {}
    handles = _hook_model(model_a, store_a) + _hook_model(model_b, store_b)
    modes = (model_a.training, model_b.training)
    try:
        model_a.eval()
        model_b.eval()
        n_batches = 0
        for batch in batches:
            batch = {k: v.to(dev) for k, v in batch.items()}
            mask = batch.get("attention_mask")
            with torch.no_grad():
                model_a.to(dev)(**batch)
                model_b.to(dev)(**batch)
            for site, xa in store_a.items():
                stats.sites.setdefault(site, PairedMoments()).update(_tokens(xa, mask), _tokens(store_b[site], mask))
            store_a.clear()
            store_b.clear()
            n_batches += 1
        log.info("activation statistics: %d batches, %d sites", n_batches, len(stats.sites))
    finally:
        for h in handles:
            h.remove()
        model_a.train(modes[0])
        model_b.train(modes[1])
    return stats
