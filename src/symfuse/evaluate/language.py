"""Causal language models on a language-modelling dataset: next-token loss and perplexity.

The loss is the mean negative log-likelihood of every predicted token (each text's first token is not predicted),
summed over the texts before dividing, so that long texts weigh by their tokens; perplexity is its exponential.
Texts are batched right-padded: a causal model's real tokens never attend to the padding after them, so the loss
equals the one of each text run alone (tested).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from symfuse.checkpoint import load_hf_model, resolve_checkpoint
from symfuse.data.batches import load_tokenizer, readable_length
from symfuse.data.labels import LM_HEADS
from symfuse.errors import CheckpointError, overflowed

LOGIT_BUDGET = 1 << 26  # logits per forward pass at most (256 MiB of float32): rows = budget / (length * vocabulary)


def load_causal_lm(model: str, device: torch.device | str) -> tuple[torch.nn.Module, Any]:
    """A causal LM checkpoint in float32, in eval mode on ``device``, and its tokenizer (right padding).

    Raises:
        CheckpointError: the folder's architecture is not a causal LM (a classifier, a bare encoder), or a bad folder.
        TokenizerError: no usable tokenizer.
    """
    from transformers import AutoConfig

    path = resolve_checkpoint(model)
    arch = (getattr(AutoConfig.from_pretrained(str(path)), "architectures", None) or ["no architecture"])[0]
    if not arch.endswith(LM_HEADS):
        raise CheckpointError(
            f"{path}: a {arch} is not a causal language model — language-modelling data is scored by next-token "
            "loss; give a ...ForCausalLM checkpoint"
        )
    tok = load_tokenizer(path)
    tok.padding_side = "right"
    if tok.pad_token is None:  # GPT-2 / Llama tokenizers: padding is masked out of the loss, any id will do
        tok.pad_token = tok.eos_token or tok.unk_token
    net = load_hf_model(path, dtype=torch.float32).to(device)
    return net, tok


@torch.no_grad()
def next_token_nll(
    net: torch.nn.Module,
    tok: Any,
    texts: Sequence[str],
    device: torch.device | str,
    batch_size: int = 8,
    max_length: int = 128,
    on_progress: Callable[[float], None] | None = None,
) -> tuple[float, int]:
    """``(summed next-token negative log-likelihood, predicted tokens)`` of ``texts`` (each cut to ``max_length``).

    A forward pass takes ``batch_size`` texts, fewer where their logits would pass :data:`LOGIT_BUDGET` (a
    vocabulary of 49,152 at 128 tokens: 10 texts).
    """
    vocab = int(getattr(net.config, "vocab_size", 0) or 1)
    batch_size = max(1, min(batch_size, LOGIT_BUDGET // (max_length * vocab)))
    total, count = 0.0, 0
    for start in range(0, len(texts), batch_size):
        enc = tok(list(texts[start : start + batch_size]), return_tensors="pt", padding=True, truncation=True,
                  max_length=max_length).to(device)  # fmt: skip
        ids, mask = enc["input_ids"], enc["attention_mask"]
        logits = net(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        target = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
        total += float(torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, ignore_index=-100,
                                                         reduction="sum"))  # fmt: skip
        count += int((target != -100).sum())
        if on_progress is not None:
            on_progress(min(1.0, (start + batch_size) / len(texts)))
    return total, count


_LOG_MAX = math.log(sys.float_info.max)  # a larger mean loss has no float perplexity


def evaluate_language_model(
    model: str,
    texts: Sequence[str],
    device: torch.device | str = "cpu",
    batch_size: int = 8,
    max_length: int = 128,
    on_progress: Callable[[float], None] | None = None,
) -> dict:
    """``loss`` (mean next-token NLL), ``perplexity``, ``tokens``, ``n`` and ``primary`` of ``model`` on ``texts``.

    Raises:
        CheckpointError: not a causal LM (see :func:`load_causal_lm`).
        ValueError: the texts hold no predicted token (every one is a single token after truncation).
    """
    t0 = time.perf_counter()
    net, tok = load_causal_lm(model, device)
    loss, count = mean_next_token_loss(net, tok, texts, model, device, batch_size, max_length, on_progress)
    return {"primary": "perplexity", "perplexity": math.exp(loss), "loss": loss, "tokens": count, "n": len(texts),
            "task": "language_modeling", "seconds": time.perf_counter() - t0}  # fmt: skip


def mean_next_token_loss(
    net: torch.nn.Module,
    tok: Any,
    texts: Sequence[str],
    model: str,
    device: torch.device | str = "cpu",
    batch_size: int = 8,
    max_length: int = 128,
    on_progress: Callable[[float], None] | None = None,
) -> tuple[float, int]:
    """``(mean next-token loss, predicted tokens)`` of a loaded causal LM (:func:`load_causal_lm`) on ``texts``.

    Texts are cut at ``max_length`` tokens, or at the positions the model reads. The loss has a float perplexity
    (``math.exp(loss)``).

    Args:
        net: The model (eval mode, on ``device``).
        tok: Its tokenizer (right padding, a pad token).
        texts: The texts scored.
        model: The model's name in error messages.
        device: Where ``net`` runs.
        batch_size: Texts per forward pass at most (see :func:`next_token_nll`).
        max_length: Tokens per text at most.
        on_progress: Called with the fraction of texts done.

    Raises:
        ValueError: the texts hold no predicted token (every one is a single token after truncation).
        NonFiniteError: the loss (or its perplexity) overflowed (:func:`symfuse.errors.overflowed`).
    """
    max_length = readable_length(max_length, net.config, model)  # past its positions: an IndexError in the forward
    total, count = next_token_nll(net, tok, texts, device, batch_size, max_length, on_progress)
    if count == 0:
        raise ValueError(f"{model}: no token to predict — every text is one token long; raise --max-length")
    loss = total / count
    if not math.isfinite(loss):
        raise overflowed(model, "its next-token loss")
    if loss > _LOG_MAX:  # math.exp raised OverflowError
        raise overflowed(model, f"its perplexity (e to the mean next-token loss, {loss:.3g})")
    return loss, count
