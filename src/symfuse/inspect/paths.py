"""The data half of ``symfuse inspect``: the loss along the straight path between two models, and merge vs ensemble.

On a fixed, seeded set of batches of a dataset (tokenised by the anchor's tokenizer, as
:func:`symfuse.evaluate.barrier.loss_barrier` does): the loss of ``(1-λ)·A + λ·B`` at a few λ
(:func:`symfuse.evaluate.barrier.interpolation_losses`) and its barrier (:func:`~symfuse.evaluate.barrier.
barrier_from_losses`), for B as given and for B aligned; and, at λ = 0.5, how far the merged model's outputs are from
the two models' ensemble (the mean of their logits): the share of positions where the two pick the same class and
the relative distance of the logits. The loss is the model's own: a task head's (:func:`symfuse.evaluate.predict.
task_loss`) or, for a causal language model, the next-token loss on the dataset's texts.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from symfuse.data import iter_batches, load_task_dataset
from symfuse.data.batches import encode_split, load_tokenizer, padding_id, readable_length
from symfuse.data.labels import is_causal_lm
from symfuse.data.text import is_language_modeling, text_split
from symfuse.errors import CheckpointError
from symfuse.evaluate.barrier import barrier_from_losses, head_space, interpolate_state, interpolation_losses
from symfuse.evaluate.predict import forward_logits, head_problem_type, load_task_model, task_loss

CAUSAL_LM = "causal_lm"
DEFAULT_LAMBDAS = (0.0, 0.25, 0.5, 0.75, 1.0)


def load_probe_model(folder: str | Path, device: torch.device) -> tuple[torch.nn.Module, Any, str]:
    """A checkpoint as a model whose loss inspect measures: ``(model, tokenizer, problem type)``.

    A causal LM (``...LMHeadModel`` / ``...ForCausalLM``) is scored by its next-token loss; any other checkpoint must
    hold a task head (:func:`symfuse.evaluate.predict.load_task_model`).
    """
    from transformers import AutoConfig

    from symfuse.checkpoint import load_hf_model, validate_checkpoint

    path = validate_checkpoint(folder, tokenizer=True)
    if is_causal_lm(AutoConfig.from_pretrained(str(path))):
        return load_hf_model(path, validate=False).to(device).eval(), load_tokenizer(path), CAUSAL_LM
    model, tok = load_task_model(path, str(device))
    return model, tok, head_problem_type(model.config)


@dataclass
class Probe:
    """A fixed set of batches and how to score a model on them.

    Attributes:
        batches: Collated batches (``input_ids``, ``attention_mask``, ``labels`` ...).
        problem: :func:`~symfuse.evaluate.predict.head_problem_type`'s answer, or ``causal_lm``.
        device: Where the models run.
    """

    batches: list[dict[str, torch.Tensor]]
    problem: str
    device: torch.device

    @torch.no_grad()
    def outputs(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, float, int]:
        """``(logits of the scored positions (n, classes) on the CPU, summed loss, number of terms)`` of one batch."""
        amp = self.device.type == "cuda"
        if self.problem == CAUSAL_LM:
            ids, mask = batch["input_ids"].to(self.device), batch["attention_mask"].to(self.device)
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=amp):
                logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
            keep = mask[:, 1:].bool()  # real next tokens only
            loss = F.cross_entropy(logits[keep], ids[:, 1:][keep], reduction="sum")
            return logits[keep].cpu(), float(loss), int(keep.sum())
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=amp):
            logits = forward_logits(model, batch, self.device)
        logits = logits.float().cpu()
        loss, n = task_loss(logits, batch["labels"], self.problem)
        return logits.reshape(-1, logits.shape[-1]), float(loss), n

    def loss(self, model: torch.nn.Module) -> float:
        """The mean loss over every batch (each term weighted once, as :func:`symfuse.evaluate.predict.run_model`)."""
        total, count = 0.0, 0
        was_training = model.training
        model.eval()
        for b in self.batches:
            _, s, n = self.outputs(model, b)
            total, count = total + s, count + n
        model.train(was_training)
        return total / count if count else float("nan")

    def ensemble_gap(self, a: torch.nn.Module, b: torch.nn.Module, merged: torch.nn.Module) -> dict[str, float]:
        """How the merged model's outputs differ from the ensemble of ``a`` and ``b`` (the mean of their logits).

        Returns:
            ``top1_agreement``: share of scored positions where both pick the same class; ``rel_logit_distance``:
            ``|merged - ensemble| / |ensemble|`` over every logit.
        """
        same = total = 0
        diff = norm = 0.0
        for batch in self.batches:
            ens = (self.outputs(a, batch)[0] + self.outputs(b, batch)[0]) / 2
            out = self.outputs(merged, batch)[0]
            same += int((out.argmax(-1) == ens.argmax(-1)).sum())
            total += ens.shape[0]
            diff += float((out - ens).double().square().sum())
            norm += float(ens.double().square().sum())
        return {"top1_agreement": same / max(total, 1), "rel_logit_distance": (diff / max(norm, 1e-30)) ** 0.5}


def make_probe(
    data: str, tokenizer: Any, problem: str, split: str, max_examples: int, batch_size: int, max_length: int,
    seed: int, device: torch.device, space: Sequence[str] | None = None, config: Any = None,
) -> Probe:  # fmt: skip
    """The batches of a dataset split, encoded as :func:`symfuse.evaluate.barrier.loss_barrier` encodes them.

    A language-modelling dataset gives its texts (a seeded subset) to causal LMs, scored by next-token loss. ``space``:
    the label space the heads' targets index (:func:`symfuse.evaluate.barrier.head_space`; None: the data's order).
    ``config``: the models' config, whose pad id the batches are padded with (:func:`~symfuse.data.batches.padding_id`).

    Raises:
        CheckpointError: language-modelling data for models with a task head.
    """
    if is_language_modeling(data):
        if problem != CAUSAL_LM:
            raise CheckpointError(f"{data}: language-modelling data scores causal LMs; these models have a {problem} "
                                  "head — give a task dataset with --data")  # fmt: skip
        texts = text_split(data, split, max_examples, seed)
        enc = [tokenizer(t, truncation=True, max_length=max_length) for t in texts]
        feats = [{"input_ids": e["input_ids"], "attention_mask": e["attention_mask"]} for e in enc]
    else:
        feats = encode_split(load_task_dataset(data), tokenizer, split, max_length, max_examples, seed, space)
    batches = list(iter_batches(feats, batch_size, padding_id(tokenizer, config), by_length=True))
    return Probe(batches, problem, device)


def _path(probe: Probe, a: torch.nn.Module, b: torch.nn.Module, lambdas: Sequence[float], label: str) -> dict:
    """Losses at ``lambdas``, the barrier and the midpoint's ensemble gap between ``a`` and ``b`` (b's class)."""
    losses = interpolation_losses(a, b, probe.loss, lambdas, template=b, label=label)
    out = {"losses": losses, **barrier_from_losses(lambdas, losses)}
    out["end_loss"] = (losses[0] + losses[-1]) / 2
    out["rel_barrier"] = out["barrier"] / out["end_loss"] if out["end_loss"] > 0 else float("inf")
    merged = copy.deepcopy(b)
    merged.load_state_dict(interpolate_state(a.state_dict(), b.state_dict(), 0.5))
    out["ensemble"] = probe.ensemble_gap(a, b, merged.eval())
    out.pop("excess")
    return out


def path_figures(
    anchor: str | Path,
    source: str | Path,
    aligned: str | Path,
    data: str,
    lambdas: Sequence[float] = DEFAULT_LAMBDAS,
    split: str = "test",
    max_examples: int = 64,
    batch_size: int = 16,
    max_length: int = 128,
    seed: int = 13,
    device: torch.device | str = "cpu",
) -> dict:
    """The loss path from the anchor to the source, and to the aligned source, on a dataset.

    Args:
        anchor: The anchor checkpoint (λ = 0); its tokenizer encodes the data.
        source: The source checkpoint (λ = 1).
        aligned: The aligned source (same function as ``source``).
        data: Dataset source (:func:`symfuse.data.load_task_dataset`).
        lambdas: Interpolation weights (0 and 1 included).
        split: The split read.
        max_examples: Seeded random subset of the split.
        batch_size: Batch size.
        max_length: Truncation length in tokens (at most the model's positions).
        seed: Subset seed.
        device: Where the models run.

    Returns:
        ``{"lambdas", "split", "examples", "plain": {...}, "aligned": {...}}``; each path holds ``losses``,
        ``barrier``, ``argmax_lambda``, ``end_loss``, ``rel_barrier`` and ``ensemble``.
    """
    dev = torch.device(device)
    model_a, tok, problem = load_probe_model(anchor, dev)
    model_b, _, _ = load_probe_model(source, dev)
    model_c, _, _ = load_probe_model(aligned, dev)
    length = readable_length(max_length, model_a.config, anchor)  # a model of fewer positions than max_length
    space = None
    if problem != CAUSAL_LM and not is_language_modeling(data):
        space = head_space(model_a.config, model_b.config, load_task_dataset(data), (anchor, source))
    probe = make_probe(data, tok, problem, split, max_examples, batch_size, length, seed, dev, space, model_a.config)
    lambdas = [float(x) for x in lambdas]
    return {
        "lambdas": lambdas,
        "split": split,
        "examples": sum(int(b["input_ids"].shape[0]) for b in probe.batches),
        "loss": problem,
        "plain": _path(probe, model_a, model_b, lambdas, f"{anchor} -> {source}"),
        "aligned": _path(probe, model_a, model_c, lambdas, f"{anchor} -> {source} (aligned)"),
    }
