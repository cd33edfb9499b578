"""Model loading, task losses and the batched prediction loop shared by fine-tuning, evaluation and barriers."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from symfuse.data.batches import IGNORE_INDEX
from symfuse.device import resolve_device

log = logging.getLogger(__name__)

MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


def head_problem_type(config: Any) -> str:
    """``token_classification`` | ``regression`` | ``multi_label_classification`` | ``single_label_classification``."""
    archs = getattr(config, "architectures", None) or []
    if any("TokenClassification" in a for a in archs):
        return "token_classification"
    if getattr(config, "problem_type", None):
        return config.problem_type
    return "regression" if config.num_labels == 1 else "single_label_classification"


def head_label_names(config: Any) -> list[str]:
    """The head's class names in output order (``config.id2label``)."""
    return [str(config.id2label[i]) for i in range(config.num_labels)]


def load_task_model(model: str | Path, device: str = "cpu") -> tuple[torch.nn.Module, Any]:
    """Load a fine-tuned (or merged) checkpoint with its task head, in eval mode, and its tokenizer.

    The head class follows ``config.architectures`` (``...ForTokenClassification`` -> token head, else a
    sequence-classification head).

    Raises:
        CheckpointError: if the folder is not a checkpoint, holds NaN / inf weights (``NonFiniteError``) or lacks
            the head's weights (a bare encoder).
        TokenizerError: if the folder has no usable tokenizer.
    """
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoModelForTokenClassification

    from symfuse.checkpoint import load_hf_model, validate_checkpoint
    from symfuse.data.batches import load_tokenizer, name_padding
    from symfuse.data.labels import is_causal_lm
    from symfuse.errors import CheckpointError

    path = validate_checkpoint(model, finite=True, tokenizer=True)
    tokenizer = load_tokenizer(path)
    config = AutoConfig.from_pretrained(str(path))
    cls = (
        AutoModelForTokenClassification
        if head_problem_type(config) == "token_classification"
        else AutoModelForSequenceClassification
    )
    net, info = load_hf_model(path, cls, validate=False, output_loading_info=True)
    name_padding(net, tokenizer)  # a decoder's classifier without a pad id cannot score a batch of two rows
    missing = sorted(info.get("missing_keys") or [])
    if missing and is_causal_lm(config):
        arch = ", ".join(config.architectures)
        raise CheckpointError(
            f"{path}: a causal language model ({arch}) has no classification head for this data — evaluate it on "
            "language-modelling data (e.g. tinyshakespeare), or a classifier fine-tuned from it"
        )
    if missing:
        raise CheckpointError(
            f"{path}: no trained task head ({len(missing)} weights missing, e.g. {missing[:3]}); evaluate a fine-tuned "
            "or merged folder that holds its classifier weights"
        )
    return net.to(resolve_device(device)).eval(), tokenizer


def task_loss(logits: torch.Tensor, labels: torch.Tensor, problem_type: str) -> tuple[torch.Tensor, int]:
    """Summed loss of a batch and the number of terms it sums, so that ``sum / count`` is the mean loss.

    Summing (not averaging) lets gradient accumulation weight micro-batches exactly like one large batch.

    Args:
        logits: ``(batch, classes)``, ``(batch, 1)`` (regression) or ``(batch, seq, tags)`` (NER).
        labels: As produced by :func:`symfuse.data.collate`.
        problem_type: See :func:`head_problem_type`.

    Returns:
        ``(loss_sum, count)``: cross-entropy / BCE-with-logits (per class) / MSE summed over its terms.
    """
    logits = logits.float()
    if problem_type == "token_classification":
        flat = labels.reshape(-1)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), flat, ignore_index=IGNORE_INDEX, reduction="sum")
        return loss, int((flat != IGNORE_INDEX).sum())
    if problem_type == "regression":
        return F.mse_loss(logits.reshape(-1), labels.float().reshape(-1), reduction="sum"), labels.numel()
    if problem_type == "multi_label_classification":
        return F.binary_cross_entropy_with_logits(logits, labels.float(), reduction="sum"), labels.numel()
    return F.cross_entropy(logits, labels, reduction="sum"), labels.shape[0]


def forward_logits(model: torch.nn.Module, batch: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    """Logits of one batch (only the inputs the model takes are passed)."""
    inputs = {k: v.to(device) for k, v in batch.items() if k in MODEL_INPUTS}
    if "token_type_ids" in inputs and getattr(model.config, "type_vocab_size", 2) in (0, None):
        inputs.pop("token_type_ids")
    return model(**inputs).logits


@torch.no_grad()
def run_model(
    model: torch.nn.Module,
    batches: Iterable[dict[str, torch.Tensor]],
    problem_type: str | None,
    device: str | torch.device = "cpu",
    amp: bool = False,
) -> tuple[list[torch.Tensor], list[torch.Tensor], float]:
    """Logits, labels and mean task loss over batches (eval mode; the model's train/eval flag is restored).

    ``problem_type=None`` skips the loss (NaN), for labels that do not index the head's outputs.

    Returns:
        ``(logits per batch (CPU, float32), labels per batch, mean loss)``.
    """
    dev = torch.device(device) if isinstance(device, str) else device
    was_training = model.training
    model.eval()
    all_logits, all_labels = [], []
    try:
        for batch in batches:
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp and dev.type == "cuda"):
                logits = forward_logits(model, batch, dev)
            all_logits.append(logits.float().cpu())
            all_labels.append(batch["labels"])
    finally:
        model.train(was_training)
    loss = mean_loss(all_logits, all_labels, problem_type) if problem_type is not None else float("nan")
    return all_logits, all_labels, loss


def mean_loss(logits: Sequence[torch.Tensor], labels: Sequence[torch.Tensor], problem_type: str) -> float:
    """Mean task loss over batches of logits and their labels (see :func:`task_loss`); NaN for no terms."""
    total, count = 0.0, 0
    for z, y in zip(logits, labels, strict=True):
        loss, n = task_loss(z, y, problem_type)
        total, count = total + float(loss), count + n
    return total / count if count else float("nan")
