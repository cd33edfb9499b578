"""Diagonal Fisher information: the mean over examples of squared per-example log-likelihood gradients.

``F = 1/N sum_n (d log p(y_n | x_n; theta) / d theta)^2`` with ``y_n`` either the gold label (``empirical``) or a
sample from the model's own predictive distribution (``sampled``, the true Fisher's Monte-Carlo estimate).
Per-example gradients are exact and do not depend on the batch composition: read from one batched pass (see
:mod:`symfuse.stats.per_example`), or, for models where that is impossible, taken one example at a time (trailing
padding trimmed, which leaves the example's outputs unchanged).

Likelihoods by head (detected from the logits' shape, ``config.problem_type`` and the label tensor):

* single-label classification: categorical, ``log softmax(logits)[y]``;
* multi-label classification: independent Bernoulli per class, ``sum_j y_j log s_j + (1 - y_j) log(1 - s_j)``;
* token classification: categorical per token, summed over labelled tokens (label != -100) of the example;
* regression (one output): Gaussian with unit variance, ``-(y - f)^2 / 2``;
* a union head (``columns``): independent Bernoullis over the dataset's own classes only, as in its training loss.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from symfuse.device import resolve_device
from symfuse.stats.gram import model_inputs
from symfuse.stats.per_example import Recorder, squared_grad_sums

log = logging.getLogger(__name__)

FisherMode = Literal["empirical", "sampled"]
IGNORE_INDEX = -100


@dataclass
class FisherStats:
    """Result of :func:`collect_fisher`: mean squared gradient per parameter name (float64) and counts."""

    fisher: dict[str, torch.Tensor]
    n_examples: int
    n_tokens: int
    mode: str


def head_kind(model: nn.Module, logits: torch.Tensor, labels: torch.Tensor | None) -> str:
    """``single`` | ``multi`` | ``token`` | ``regression`` for a model's outputs (see the module docstring)."""
    problem = getattr(model.config, "problem_type", None)
    if logits.dim() == 3:
        return "token"
    if problem == "multi_label_classification" or (
        labels is not None and labels.is_floating_point() and labels.dim() == 2
    ):
        return "multi"
    if problem == "regression" or logits.shape[-1] == 1:
        return "regression"
    return "single"


def sample_labels(kind: str, logits: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Labels drawn from the model's predictive distribution (for the ``sampled`` Fisher)."""
    logits = logits.detach().float().cpu()
    if kind == "single":
        return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)
    if kind == "token":  # (1, seq, C) -> (1, seq)
        probs = logits.softmax(-1).reshape(-1, logits.shape[-1])
        return torch.multinomial(probs, 1, generator=generator).reshape(logits.shape[:-1])
    if kind == "multi":
        return torch.bernoulli(torch.sigmoid(logits), generator=generator)
    return logits.squeeze(-1) + torch.randn(logits.shape[:-1], generator=generator)


def _f(t: torch.Tensor) -> torch.Tensor:
    """At least float32 (float64 stays float64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32)) if t.is_floating_point() else t.float()


def log_likelihood(
    kind: str, logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """Summed log-likelihood of ``labels`` under ``logits`` (one example, batch dim 1).

    Args:
        kind: From :func:`head_kind`.
        logits: (1, C), (1, seq, C) or (1, 1).
        labels: (1,), (1, seq), (1, C) multi-hot, or (1,) float.
        valid: Token positions that count (token classification).

    Returns:
        A scalar.
    """
    if kind == "single":
        return F.log_softmax(_f(logits), -1).gather(-1, labels.long().view(-1, 1)).sum()
    if kind == "token":
        lp = F.log_softmax(_f(logits), -1)  # (1, seq, C)
        keep = valid if valid is not None else labels != IGNORE_INDEX
        lab = labels.long().clamp_min(0)
        return (lp.gather(-1, lab.unsqueeze(-1)).squeeze(-1) * keep).sum()
    if kind == "multi":
        return -F.binary_cross_entropy_with_logits(_f(logits), _f(labels), reduction="sum")
    return -0.5 * ((_f(labels).view(-1) - _f(logits).view(-1)) ** 2).sum()


def collect_fisher(
    model: nn.Module,
    batches: Iterable[Mapping[str, torch.Tensor]],
    mode: FisherMode = "empirical",
    seed: int = 0,
    device: str | torch.device = "cpu",
    progress: bool = True,
    columns: Sequence[int] | None = None,
) -> FisherStats:
    """Diagonal Fisher of every trainable parameter over a stream of labelled batches.

    Each batch takes one forward and one backward pass (per-example gradients recovered exactly from the modules'
    inputs and output gradients, see :mod:`symfuse.stats.per_example`); models where that is impossible (a
    parameter read outside a module call, like DeBERTa's relative embeddings) fall back to one pass per example.
    Both give the same numbers: batch padding is trimmed per example in the loop and masked in the batch.

    Args:
        model: A transformers model with a classification / token-classification / regression head (eval
            mode is used: no dropout). Not modified; its ``.grad`` fields are left as found (None).
        batches: Batches with ``labels`` as built by :func:`symfuse.data.make_batches`.
        mode: ``empirical`` (gold labels) or ``sampled`` (labels drawn from the model, seeded; drawn example by
            example in the stream's order, so batching does not change them).
        seed: Seed of the label sampling.
        device: Where to run.
        progress: Show a tqdm progress bar when stderr is a terminal.
        columns: A union head's outputs of the dataset's own classes (:func:`symfuse.data.labels.union_columns`,
            in the dataset's label order): the likelihood is the training loss's, independent Bernoullis over
            those outputs only, with the gold class (or the multi-hot gold) as target; the other classes' rows
            get no gradient.

    Returns:
        Mean squared per-example gradients by parameter name (float64, on CPU).

    Raises:
        ValueError: on an unknown mode, or ``empirical`` without labels.
    """
    if mode not in ("empirical", "sampled"):
        raise ValueError(f"unknown Fisher mode {mode!r}; use 'empirical' or 'sampled'")
    device = resolve_device(device)
    gen = torch.Generator().manual_seed(seed)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    acc = {n: torch.zeros(p.shape, dtype=torch.float64) for n, p in params.items()}
    was_training = model.training
    model.eval()
    model.to(device)
    n_examples = n_tokens = 0
    batched = True  # until a batch shows the model's per-example gradients cannot be read from its modules
    try:
        for batch in tqdm(batches, desc=f"fisher ({mode})", disable=None if progress else True, unit="batch"):
            inputs = model_inputs(batch, "cpu")
            labels = batch.get("labels")
            if mode == "empirical" and labels is None:
                raise ValueError("empirical Fisher needs gold labels: the batches carry no 'labels'")
            if labels is not None and columns is not None:
                labels = _own_targets(labels, columns)
            first = next(iter(inputs.values()))
            mask = inputs.get("attention_mask")
            lengths = [
                int(mask[i].nonzero().max()) + 1 if mask is not None and mask[i].any() else first.shape[1]
                for i in range(first.shape[0])
            ]
            if batched:
                batched = _batch_pass(model, params, inputs, labels, lengths, mode, gen, device, acc, columns)
                if not batched:
                    log.info("%s: per-example gradients not readable from its modules; one pass per example",
                             type(model).__name__)  # fmt: skip
            if not batched:
                _loop_pass(model, params, inputs, labels, lengths, mode, gen, device, acc, columns)
            n_examples += len(lengths)
            n_tokens += sum(lengths) if mask is None else int(mask.sum())
    finally:
        model.train(was_training)
    if n_examples == 0:
        raise ValueError("no examples: cannot estimate a Fisher from an empty dataset")
    return FisherStats({n: a / n_examples for n, a in acc.items()}, n_examples, n_tokens, mode)


def _own_targets(labels: torch.Tensor, columns: Sequence[int]) -> torch.Tensor:
    """Multi-hot float targets over a union head's own columns (class ids one-hot; multi-hot gold as it is)."""
    if labels.is_floating_point():
        return labels.float()
    return F.one_hot(labels.long(), len(columns)).float()


def _logits(model: nn.Module, ex: Mapping[str, torch.Tensor], columns: Sequence[int] | None = None) -> torch.Tensor:
    logits = getattr(model(**ex), "logits", None)
    if logits is None:
        raise ValueError(
            f"{type(model).__name__} has no task head (no logits): the Fisher needs a likelihood; "
            "collect it on a fine-tuned checkpoint with a classification head"
        )
    return logits if columns is None else logits[..., list(columns)]


def _trim(inputs: Mapping[str, torch.Tensor], rows: slice, length: int, device: torch.device) -> dict:
    return {
        k: v[rows].to(device) if k == "pixel_values" or v.dim() < 2 else v[rows, :length].to(device)
        for k, v in inputs.items()
    }


def _example_labels(labels: torch.Tensor | None, i: int, length: int) -> torch.Tensor | None:
    if labels is None:
        return None
    lab = labels[i : i + 1]
    return lab[:, :length] if lab.dim() == 2 and not lab.is_floating_point() else lab


def _batch_pass(model, params, inputs, labels, lengths, mode, gen, device, acc, columns=None) -> bool:
    """One forward/backward for the whole batch; ``False`` (nothing drawn or added) when it cannot be exact."""
    width = max(lengths)
    ex = _trim(inputs, slice(None), width, device)
    with Recorder(model, params, len(lengths)) as rec:
        logits = _logits(model, ex, columns)
        if not rec.usable():
            return False
        lab = labels
        if lab is not None and lab.dim() == 2 and not lab.is_floating_point():
            lab = lab[:, :width]
        kind = head_kind(model, logits, None if lab is None else lab[:1])
        valid = None
        if kind == "token":
            pos = torch.arange(logits.shape[1])[None, :] < torch.tensor(lengths)[:, None]
            valid = ((lab != IGNORE_INDEX) if lab is not None else ex["attention_mask"].cpu().bool()) & pos
        if mode == "sampled":
            lab = _sample_each(kind, logits, lengths, gen)
        ll = log_likelihood(kind, logits, lab.to(logits.device), None if valid is None else valid.to(logits.device))
    squared_grad_sums(rec, ll, acc)  # hooks removed: the per-module vmaps call modules again
    return True


def _sample_each(kind: str, logits: torch.Tensor, lengths: list[int], gen: torch.Generator) -> torch.Tensor:
    """Labels drawn example by example (trailing padding trimmed), the generator used as the loop uses it."""
    if kind != "token":
        return torch.cat([sample_labels(kind, logits[i : i + 1], gen) for i in range(len(lengths))])
    out = torch.zeros(logits.shape[:2], dtype=torch.long)
    for i, n in enumerate(lengths):
        out[i, :n] = sample_labels(kind, logits[i : i + 1, :n], gen)[0]
    return out


def _loop_pass(model, params, inputs, labels, lengths, mode, gen, device, acc, columns=None) -> None:
    """One forward/backward per example, trailing padding trimmed (exact, slow: the fallback)."""
    for i, length in enumerate(lengths):
        ex = _trim(inputs, slice(i, i + 1), length, device)
        lab = _example_labels(labels, i, length)
        logits = _logits(model, ex, columns)
        kind = head_kind(model, logits, lab)
        valid = None
        if kind == "token":
            valid = (lab != IGNORE_INDEX) if lab is not None else ex["attention_mask"].bool()
            valid = valid.to(logits.device)
        if mode == "sampled":
            lab = sample_labels(kind, logits, gen)
        ll = log_likelihood(kind, logits, lab.to(logits.device), valid)
        grads = torch.autograd.grad(ll, list(params.values()), allow_unused=True)
        for (n, _), g in zip(params.items(), grads, strict=True):
            if g is not None:
                acc[n] += g.detach().to("cpu", torch.float64) ** 2
