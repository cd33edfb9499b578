"""Sums of squared per-example gradients from ONE batched forward and backward pass (no per-example loop).

Forward hooks record, for every module that owns trainable parameters, its input and output at every call; one
``torch.autograd.grad`` of the batch's summed log-likelihood with respect to those outputs gives each call's
output gradient, whose row ``b`` depends on example ``b`` only (eval mode, examples do not interact). Per-example
parameter gradients then follow exactly, module by module:

* ``nn.Linear`` / HF ``Conv1D``: ``g_W[b] = sum_t dY[b, t] (x) X[b, t]``, ``g_bias[b] = sum_t dY[b, t]``;
* ``nn.LayerNorm``: ``g_gamma[b] = sum_t dY[b, t] * Xhat[b, t]``, ``g_beta[b] = sum_t dY[b, t]``;
* ``nn.Embedding``: each example's output-gradient rows summed per token id (sparse; padding_idx gets none);
* any other module owning parameters (RMSNorm, Conv2d, ViT embeddings...): ``torch.func.vmap`` of the gradient
  of ``<module(x_b), dY_b>`` over the batch.

Each per-example gradient is squared in float64 and summed over the batch. A parameter reached by several calls
(shared modules) has its per-example gradients summed over the calls before squaring. The pass refuses (returns
``False``) when some trainable parameter is used outside a recordable call (e.g. DeBERTa's relative embeddings
read as ``.weight``) or a call's input is not batch-first; the caller then loops over examples.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

_LINEAR_LIKE = ("Conv1D",)  # transformers.pytorch_utils.Conv1D: y = x @ W + b with W (in, out)


@dataclass
class _Call:
    module: nn.Module
    args: tuple
    kwargs: dict
    output: torch.Tensor


@dataclass
class Recorder:
    """Forward hooks on every module owning trainable parameters of ``params`` (name -> parameter)."""

    model: nn.Module
    params: dict[str, torch.Tensor]
    batch_size: int
    calls: list[_Call] = field(default_factory=list)
    owned: dict[nn.Module, dict[str, str]] = field(default_factory=dict)  # module -> local name -> full name
    ok: bool = True
    _handles: list = field(default_factory=list)

    def __enter__(self) -> Recorder:
        by_id = {id(p): n for n, p in self.params.items()}
        for module in self.model.modules():
            local = {k: by_id[id(p)] for k, p in module.named_parameters(recurse=False) if id(p) in by_id}
            if local:
                self.owned[module] = local
                self._handles.append(module.register_forward_hook(self._hook, with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()

    def uses(self) -> dict[str, int]:
        """Recorded calls per parameter name."""
        out: dict[str, int] = {}
        for c in self.calls:
            for n in self.owned[c.module].values():
                out[n] = out.get(n, 0) + 1
        return out

    def usable(self) -> bool:
        """Whether the recorded calls give every parameter's per-example gradients exactly."""
        if not self.ok or any(
            c.args[0].dim() < 2
            or c.args[0].shape[0] != self.batch_size
            or not c.output.requires_grad
            or any(isinstance(v, torch.Tensor) for v in c.kwargs.values())  # unbatched under vmap: could broadcast
            for c in self.calls
        ):
            return False
        uses = self.uses()
        if set(uses) != set(self.params):  # a parameter read outside a module call
            return False
        return not any(  # a shared embedding would need dense per-example gradients
            isinstance(c.module, nn.Embedding) and uses[n] > 1
            for c in self.calls
            for n in self.owned[c.module].values()
        )

    def _hook(self, module: nn.Module, args: tuple, kwargs: dict, output) -> torch.Tensor | None:
        if not isinstance(output, torch.Tensor) or not args or not isinstance(args[0], torch.Tensor):
            self.ok = False
            return None
        if isinstance(module, nn.Embedding) and args[0].shape[0] == 1 < self.batch_size:
            # ids shared by the batch (BERT / GPT-2 position ids): give each example its own copy of the output so
            # that its gradient comes back per example (the model only broadcasts it against batch tensors)
            args = (args[0].expand(self.batch_size, *args[0].shape[1:]), *args[1:])
            output = output.expand(self.batch_size, *output.shape[1:])
            self.calls.append(_Call(module, args, kwargs, output))
            return output
        self.calls.append(_Call(module, args, kwargs, output))
        return None


def squared_grad_sums(recorder: Recorder, ll: torch.Tensor, acc: dict[str, torch.Tensor]) -> None:
    """Add ``sum_b g_b^2`` (float64, CPU) to ``acc`` for every parameter (``recorder.usable`` must be true).

    Args:
        recorder: The hooks that watched the forward pass producing ``ll``.
        ll: Sum over the batch of the per-example log-likelihoods.
        acc: Running sums by parameter name.
    """
    calls, uses = recorder.calls, recorder.uses()
    outs = [c.output for c in calls]
    out_grads = torch.autograd.grad(ll, outs, allow_unused=True)
    pending: dict[str, torch.Tensor] = {}
    for c, go in zip(calls, out_grads, strict=True):
        if go is None:
            continue
        names = recorder.owned[c.module]
        for name, g in _per_example(c, go.detach(), names, {n for n in names.values() if uses[n] == 1}).items():
            if isinstance(g, _SparseSq):
                acc[name].index_add_(0, g.rows.cpu(), g.values.cpu())
            elif isinstance(g, _SquareSum):
                acc[name] += g.total.cpu()
            elif uses[name] == 1:
                acc[name] += (g.double() ** 2).sum(0).cpu()
            else:
                pending[name] = pending.get(name, 0) + g.double()
    for name, g in pending.items():
        acc[name] += (g**2).sum(0).cpu()


@dataclass
class _SquareSum:
    """``sum_b g_b^2`` already reduced over the batch (a parameter with one recorded call)."""

    total: torch.Tensor


# Per-example outer products are formed this many bytes at a time: a chunk stays in cache-sized, reusable buffers
# instead of one (batch, out, in) tensor per layer and its float64 copies (page faults were most of the time).
_CHUNK_BYTES = 1 << 23


def _outer_square_sum(gs: torch.Tensor, xs: torch.Tensor, transposed: bool) -> torch.Tensor:
    """``sum_b (gs[b]^T xs[b])^2`` (``(xs[b]^T gs[b])^2`` when ``transposed``), float64, in batch chunks.

    Each chunk's per-example products are squared in float32 (float64 stays float64; bfloat16 / float16 products
    are promoted first) and summed over the chunk in float64.
    """
    b, o, i = gs.shape[0], gs.shape[-1], xs.shape[-1]
    step = max(1, _CHUNK_BYTES // max(1, o * i * gs.element_size()))
    total = torch.zeros((i, o) if transposed else (o, i), dtype=torch.float64, device=gs.device)
    for s in range(0, b, step):
        g_c, x_c = gs[s : s + step], xs[s : s + step]
        prod = torch.bmm(x_c.transpose(1, 2), g_c) if transposed else torch.bmm(g_c.transpose(1, 2), x_c)
        prod = prod.to(torch.promote_types(prod.dtype, torch.float32))  # a new tensor, or ours: squared in place
        total += prod.square_().sum(0, dtype=torch.float64)
    return total


@dataclass
class _SparseSq:
    """Squared per-example embedding gradients, as rows to add (with repeats) and their values."""

    rows: torch.Tensor
    values: torch.Tensor


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1, t.shape[-1])


def _per_example(
    call: _Call, go: torch.Tensor, names: dict[str, str], single: frozenset[str] | set[str] = frozenset()
) -> dict[str, torch.Tensor | _SparseSq | _SquareSum]:
    """Per-example gradients of one call's parameters; those in ``single`` (one call) may come back squared-summed."""
    m, x = call.module, call.args[0].detach()
    kind = type(m).__name__
    if isinstance(m, nn.Linear) or kind in _LINEAR_LIKE:
        xs, gs = _flat(x), _flat(go).to(x.dtype)
        out: dict[str, torch.Tensor | _SparseSq | _SquareSum] = {}
        if "weight" in names:
            transposed = not isinstance(m, nn.Linear)
            if names["weight"] in single:
                out[names["weight"]] = _SquareSum(_outer_square_sum(gs, xs, transposed))
            else:
                spec = "bto,bti->bio" if transposed else "bto,bti->boi"
                out[names["weight"]] = torch.einsum(spec, gs, xs)
        if "bias" in names:
            out[names["bias"]] = gs.sum(1)
        return out
    if isinstance(m, nn.LayerNorm) and len(m.normalized_shape) == 1:
        dt = torch.promote_types(x.dtype, torch.float32)
        xs, gs = _flat(x).to(dt), _flat(go).to(dt)
        mean = xs.mean(-1, keepdim=True)
        xhat = (xs - mean) / torch.sqrt(xs.var(-1, unbiased=False, keepdim=True) + m.eps)
        out = {}
        if "weight" in names:
            out[names["weight"]] = (gs * xhat).sum(1)
        if "bias" in names:
            out[names["bias"]] = gs.sum(1)
        return out
    if isinstance(m, nn.Embedding) and not (m.max_norm or m.scale_grad_by_freq or m.sparse):
        return {names["weight"]: _embedding_sq(m, x, go)}
    return _vmapped(call, go, names)


def _embedding_sq(m: nn.Embedding, ids: torch.Tensor, go: torch.Tensor) -> _SparseSq:
    b = ids.shape[0]
    ids = ids.reshape(b, -1)
    gs = go.reshape(b, ids.shape[1], -1).double()
    keys = ids + m.num_embeddings * torch.arange(b, device=ids.device).view(-1, 1)
    keep = ids != m.padding_idx if m.padding_idx is not None else torch.ones_like(ids, dtype=torch.bool)
    uniq, inv = torch.unique(keys[keep], return_inverse=True)
    summed = torch.zeros(len(uniq), gs.shape[-1], dtype=torch.float64, device=gs.device)
    summed.index_add_(0, inv, gs[keep])
    return _SparseSq(uniq % m.num_embeddings, summed**2)


def _vmapped(call: _Call, go: torch.Tensor, names: dict[str, str]) -> dict[str, torch.Tensor]:
    from torch.func import functional_call, grad, vmap

    m = call.module
    local = {k: p.detach() for k, p in m.named_parameters(recurse=False) if k in names}
    batched = [isinstance(a, torch.Tensor) and a.dim() >= 1 and a.shape[0] == go.shape[0] for a in call.args]

    def one(params: dict, go_b: torch.Tensor, *args_b) -> torch.Tensor:
        it = iter(args_b)
        args = tuple(next(it).unsqueeze(0) if bt else a for a, bt in zip(call.args, batched, strict=True))
        out = functional_call(m, params, args, call.kwargs)
        return (out.to(go_b.dtype) * go_b.unsqueeze(0)).sum()

    args_b = [a.detach() for a, bt in zip(call.args, batched, strict=True) if bt]
    fn: Callable = vmap(grad(one), in_dims=(None, 0, *([0] * len(args_b))), randomness="different")
    per = fn(local, go, *args_b)
    return {names[k]: v for k, v in per.items()}
