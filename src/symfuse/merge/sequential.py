"""RegMean++'s statistics: each layer's input Grams collected on the partially MERGED model, layer by layer.

:func:`regmean_plusplus_state` merges K models of one architecture family (:mod:`symfuse.arch`) with
:func:`symfuse.merge.regmean_plusplus.regmean_plusplus`, in stages (as FusionBench's ``regmean_plusplus``):

0. Everything outside the layer stack except the linear layers that run after it: embedding tables and norms get
   the weighted mean, linear layers that run BEFORE the stack (ELECTRA ``embeddings_project``) get RegMean with
   each candidate's own Grams (the merged prefix is empty, so this is RegMean).
1. Layer ``l = 0 .. L-1``: each model ``i``'s data runs through the merged embeddings and merged layers
   ``0 .. l-1`` (hidden states cached at the layer boundary, so every layer is run once per batch: O(L) forwards),
   then through candidate ``i``'s layer ``l``, whose hooks collect the Gram of every linear input of the layer;
   the layer is merged, and the cached states advance through the MERGED layer ``l``.
2. The linear layers after the stack (pooler, classifier, LM head, score): Grams of candidate ``i``'s own tail on
   the fully merged body (one full forward per model).

Grams follow :func:`symfuse.stats.gram.collect_gram`'s rules (padding rows excluded for (batch, seq, in) inputs,
each batch's product in float32, sums in float64), so with identical embeddings the first layer's Grams, and its
merged weights, are exactly RegMean's. Tensors named in ``keep`` (per-dataset heads) are not merged.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from symfuse.arch.registry import get_spec
from symfuse.device import resolve_device
from symfuse.errors import UnsupportedArchitecture
from symfuse.merge.regmean_plusplus import regmean_plusplus
from symfuse.stats.gram import GramHooks, collect_gram, is_conv1d, linear_modules, model_inputs

log = logging.getLogger(__name__)

Batch = Mapping[str, torch.Tensor]


class _Stop(Exception):
    """Raised by a hook to end a forward pass early."""


def layer_paths(model: nn.Module) -> list[str]:
    """Module paths of the model's layer stack, in forward order (from its family spec).

    Raises:
        UnsupportedArchitecture: no spec for the model type, or a stored layer applied several times (ALBERT).
    """
    spec = get_spec(model.config)
    spec, prefix = spec.for_checkpoint(dict(model.named_parameters()).keys())
    if spec.n_layers_key != "num_hidden_layers":
        raise UnsupportedArchitecture(
            f"regmean++: {model.config.model_type} applies one stored layer several times; it needs one stored layer "
            "per application — use regmean"
        )
    n = int(spec.geometry(model.config).n_layers)
    return [prefix + spec.layer.format(i=i) for i in range(n)]


def _floating_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach() for n, t in model.state_dict().items() if t.is_floating_point()}


def _layer_out(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def _capture_layer_inputs(
    model: nn.Module, layers: Sequence[nn.Module], batch: Batch, device: torch.device
) -> tuple[torch.Tensor, list[tuple[tuple, dict]]]:
    """One forward of ``model``: layer 0's hidden states and every layer's other arguments (masks, positions).

    Raises:
        UnsupportedArchitecture: the layers are not each called once, in order.
    """
    seen: list[tuple[int, tuple, dict]] = []

    def pre(i: int):
        def fn(_mod: nn.Module, args: tuple, kwargs: dict) -> None:
            seen.append((i, args, kwargs))
            if i == len(layers) - 1:
                raise _Stop

        return fn

    handles = [m.register_forward_pre_hook(pre(i), with_kwargs=True) for i, m in enumerate(layers)]
    try:
        kw = {"use_cache": False} if getattr(model.config, "use_cache", False) else {}
        model(**model_inputs(batch, device), **kw)
    except _Stop:
        pass
    finally:
        for h in handles:
            h.remove()
    if [i for i, _, _ in seen] != list(range(len(layers))):
        raise UnsupportedArchitecture(
            f"regmean++: the layers of {model.config.model_type} are not called once each in order — use regmean"
        )
    first_args, first_kwargs = seen[0][1], seen[0][2]
    hidden = first_args[0] if first_args else first_kwargs["hidden_states"]
    rest = []
    for _, args, kwargs in seen:
        kwargs = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        rest.append((tuple(args[1:]), kwargs))
    return hidden, rest


def _outside_linears(
    model: nn.Module, lins: Mapping[str, nn.Module], paths: Sequence[str], batch: Batch, device: torch.device
) -> tuple[list[str], list[str]]:
    """The linear modules outside the layer stack: ``(those that run before layer 0, all of them)``.

    One forward of ``model`` on ``batch`` (stopped at the last layer) records which ran before the stack.
    """
    outside = {m: mod for m, mod in lins.items() if not any(m.startswith(p + ".") for p in paths)}
    order: list[str] = []
    hooks = [mod.register_forward_hook(lambda *_a, m=m: order.append(m)) for m, mod in outside.items()]
    hooks.append(model.get_submodule(paths[0]).register_forward_pre_hook(lambda *_a: order.append("<layers>")))
    was = model.training
    try:
        model.eval().to(device)
        with torch.no_grad():
            _capture_layer_inputs(model, [model.get_submodule(p) for p in paths], batch, device)
    finally:
        for h in hooks:
            h.remove()
        model.train(was)
    cut = order.index("<layers>") if "<layers>" in order else len(order)
    return [m for m in dict.fromkeys(order[:cut]) if m in outside], list(outside)


def _common_names(states: Sequence[dict[str, torch.Tensor]], keep: set[str]) -> list[str]:
    """The tensor names to merge (model 0's order); every model must hold them with the same shapes."""
    names = [n for n in states[0] if n not in keep]
    for i, s in enumerate(states[1:], 1):
        mine = {n for n in s if n not in keep}
        if mine != set(names):
            diff = sorted(mine.symmetric_difference(names))[:5]
            raise ValueError(f"regmean++: model {i}'s tensors differ from model 0's (e.g. {diff})")
        bad = [n for n in names if s[n].shape != states[0][n].shape]
        if bad:
            raise ValueError(f"regmean++: model {i}: {bad[0]} has shape {tuple(s[bad[0]].shape)}, model 0 differs")
    return names


def _tied_names(model: nn.Module) -> set[str]:
    """State-dict names sharing storage with another (e.g. an LM head tied to the embeddings)."""
    ptrs: dict[int, list[str]] = {}
    for n, t in model.state_dict().items():
        ptrs.setdefault(t.data_ptr(), []).append(n)
    return {n for ns in ptrs.values() if len(ns) > 1 for n in ns}


class _Stages(NamedTuple):
    """RegMean++'s stages: tensor names per stage (outside, layer 0 .. L-1, tail) and the modules they need."""

    paths: list[str]  # the layer stack
    pre: list[str]  # linear modules that run before the stack
    tail: list[str]  # linear modules after the stack (merged last, on the full merged body)
    names: list[list[str]]  # tensor names per stage
    conv1d: list[str]  # weights stored transposed (GPT-2's Conv1D)


def _stages(model: nn.Module, names: Sequence[str], batch: Batch, dev: torch.device) -> _Stages:
    """Split ``names`` into stages (one forward of ``model`` on ``batch`` finds the linear layers before the stack)."""
    paths = layer_paths(model)
    in_layer = {n: next((i for i, p in enumerate(paths) if n.startswith(p + ".")), None) for n in names}
    lins = linear_modules(model)
    pre, outside = _outside_linears(model, lins, paths, batch, dev)
    tied = _tied_names(model)
    tail = [m for m in outside if m not in pre and f"{m}.weight" in names and f"{m}.weight" not in tied]
    tail_names = {n for m in tail for n in (f"{m}.weight", f"{m}.bias") if n in names}
    stages = [[n for n in names if in_layer[n] is None and n not in tail_names]]
    stages += [[n for n in names if in_layer[n] == i] for i in range(len(paths))]
    stages.append([n for n in names if n in tail_names])
    conv1d = [f"{m}.weight" for m, mod in lins.items() if is_conv1d(mod)]
    return _Stages(paths, pre, tail, stages, conv1d)


def _load(model: nn.Module, merged: Mapping[str, torch.Tensor]) -> None:
    missing = model.load_state_dict(dict(merged), strict=False).unexpected_keys
    if missing:
        raise ValueError(f"regmean++: merged tensors {missing[:3]} are not in the model")


class _MergedPrefixGrams:
    """RegMean++'s ``collect(stage, merged)``: each model's Grams of a stage, on its data through the merged prefix.

    Each model's hidden states are cached at the boundary of the layer being merged (with every layer's other
    arguments), so each layer runs once per batch.
    """

    def __init__(
        self,
        models: Sequence[nn.Module],
        batches: Sequence[Sequence[Batch]],
        st: _Stages,
        dev: torch.device,
        tail_grams: dict[str, list[torch.Tensor]] | None,
    ):
        self.models, self.batches, self.st, self.dev, self.tail_grams = models, batches, st, dev, tail_grams
        self.merged_model = copy.deepcopy(models[0]).eval().to(dev)
        self.merged_layers = [self.merged_model.get_submodule(p) for p in st.paths]
        self.cache: list[list[tuple[torch.Tensor, torch.Tensor | None]]] = []  # per model, batch: (hidden, mask)
        self.extra: list[list[list[tuple[tuple, dict]]]] = []  # per model, batch, layer: other layer arguments

    def _grams(self, model: nn.Module, modules: Sequence[str], data: Sequence[Batch]) -> dict[str, torch.Tensor]:
        if not modules:
            return {}
        g = collect_gram(model, data, device=self.dev, progress=False, modules=modules)
        return {f"{m}.weight": t for m, t in g.grams.items()}

    def __call__(self, stage: int, merged: Sequence[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        """The K models' Grams of ``stage`` (0: before the stack, 1..L: layer ``stage - 1``, L+1: the tail)."""
        if stage == 0:
            return [self._grams(m, self.st.pre, b) for m, b in zip(self.models, self.batches, strict=True)]
        _load(self.merged_model, merged[-1])
        layer = stage - 1
        with torch.no_grad():
            if layer == 0:
                self._capture()
            elif layer < len(self.st.paths):
                self._advance(layer - 1)
        if layer == len(self.st.paths):
            return self._tail(merged)
        return self._layer(layer)

    def _capture(self) -> None:
        """The merged embeddings' outputs on every model's data, and every layer's other arguments."""
        for b in self.batches:
            got = [_capture_layer_inputs(self.merged_model, self.merged_layers, batch, self.dev) for batch in b]
            masks = [model_inputs(batch, self.dev).get("attention_mask") for batch in b]
            self.cache.append([(h, m) for (h, _), m in zip(got, masks, strict=True)])
            self.extra.append([rest for _, rest in got])

    def _advance(self, layer: int) -> None:
        """Move every cached state through the merged layer ``layer`` (just finished)."""
        done = self.merged_layers[layer]
        for i, states in enumerate(self.cache):
            self.cache[i] = [
                (_layer_out(done(h, *self.extra[i][j][layer][0], **self.extra[i][j][layer][1])), m)
                for j, (h, m) in enumerate(states)
            ]

    def _tail(self, merged: Sequence[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        """Candidate i's own tail on the fully merged body: the Grams of its linear layers after the stack."""
        body = {n: t for s in merged for n, t in s.items()}
        out = []
        for m, b in zip(self.models, self.batches, strict=True):
            cand = copy.deepcopy(m)
            _load(cand, body)
            out.append(self._grams(cand, self.st.tail, b))
            del cand
        if self.tail_grams is not None:
            for name in out[0]:
                if all(name in o for o in out):
                    self.tail_grams[name.removesuffix(".weight")] = [o[name] for o in out]
        return out

    def _layer(self, layer: int) -> list[dict[str, torch.Tensor]]:
        """Each candidate's own layer ``layer`` on its cached states: the Grams of the layer's linear inputs."""
        path = self.st.paths[layer]
        out = []
        for i, m in enumerate(self.models):
            cand = m.get_submodule(path)
            was = cand.training
            cand.eval().to(self.dev)
            hooks = GramHooks({f"{path}.{n}": mod for n, mod in linear_modules(cand).items()})
            try:
                with torch.no_grad():
                    for j, (h, mask) in enumerate(self.cache[i]):
                        hooks.batch(mask)
                        args, kwargs = self.extra[i][j][layer]
                        cand(h, *args, **kwargs)
            finally:
                hooks.close()
                cand.train(was)
            out.append({f"{n}.weight": g for n, g in hooks.means().items()})
        log.info("regmean++: layer %d/%d Grams collected", layer + 1, len(self.st.paths))
        return out


def regmean_plusplus_state(
    models: Sequence[nn.Module],
    batches: Sequence[Sequence[Batch]],
    model_weights: Sequence[float] | None = None,
    alpha: float = 0.9,
    keep: Iterable[str] = (),
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float64,
    tail_grams: dict[str, list[torch.Tensor]] | None = None,
) -> dict[str, torch.Tensor]:
    """Merge K models with RegMean++ (see the module docstring); the caller's weights are not modified.

    Args:
        models: K transformers models of one family and shape (any head), e.g. from
            :func:`symfuse.checkpoint.load_hf_model`.
        batches: Per model, its own data as tokenised batches (:func:`symfuse.data.make_batches`).
        model_weights: K non-negative model weights (default 1 each).
        alpha: RegMean off-diagonal scale in [0, 1].
        keep: Tensor names not merged (per-dataset heads); they are left out of the result.
        device: Where the forward passes run.
        dtype: Solve precision.
        tail_grams: If given, filled with the Grams of the linear layers after the stack, ``{module: [K Grams]}``
            (each model's on the fully merged body): a caller may re-solve those layers over a subset of the models
            or of their rows (union heads, merged class by class).

    Returns:
        ``{name: merged tensor}`` (CPU, the models' dtypes) for every floating tensor of the state dict not in
        ``keep``.

    Raises:
        ValueError: K differs between ``models`` and ``batches``, a model has no batches, or the models' tensors
            differ in names or shapes (outside ``keep``).
        UnsupportedArchitecture: a family without a spec, or whose layers are not applied once each in order.
    """
    k = len(models)
    if k == 0 or len(batches) != k:
        raise ValueError(f"regmean++: {k} models and {len(batches)} data loaders; give one loader per model")
    if any(len(b) == 0 for b in batches):
        raise ValueError("regmean++: a model has no data batches; give each model a non-empty data sample")
    dev = resolve_device(device)
    states = [_floating_state(m) for m in models]
    names = _common_names(states, set(keep))
    st = _stages(models[0], names, batches[0][0], dev)
    tensors = [[{n: s[n] for n in stage} for s in states] for stage in st.names]
    collect = _MergedPrefixGrams(models, batches, st, dev, tail_grams)
    try:
        merged = regmean_plusplus(tensors, collect, model_weights, alpha, conv1d=st.conv1d, dtype=dtype)
    finally:
        for m in models:
            m.to("cpu")
    return {n: t.detach().cpu().clone() for s in merged for n, t in s.items()}
