"""Corpus, vocabulary, model and MLM loss of the different-initialisation experiment (``different_init.py``).

The text of every shared dataset, tokenised with MiniLM's tokenizer, re-indexed to the corpus vocabulary and
packed into fixed-length blocks (cached under ``bench/out/different_init``); a small BERT MLM built from a seed.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import torch
import transformers as T

from symfuse.checkpoint import resolve_checkpoint

log = logging.getLogger("different_init")

DATASETS = Path("/work/shared/datasets")
WORK = Path("bench/out/different_init")
RESULTS = Path("bench/results")
SEQ = 64
# d 128 rather than 256: ~3x cheaper per step on one CPU thread, so the models see ~3x more text per hour.
MODEL = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, intermediate_size=512)
SPECIAL = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")  # MiniLM ids 0, 100, 101, 102, 103 -> new ids 0..4


# ------------------------------------------------------------------------------------------------ data
def _texts(split: str) -> list[str]:
    """Every text of every shared dataset's ``split`` (token lists joined), deduplicated, in a fixed order."""
    seen: dict[str, None] = {}
    for f in sorted(DATASETS.glob(f"*/{split}.jsonl")):
        for line in f.read_text().splitlines():
            row = json.loads(line)
            parts = [row[k] for k in ("text", "text_pair") if isinstance(row.get(k), str)]
            if isinstance(row.get("tokens"), list):
                parts.append(" ".join(row["tokens"]))
            for p in parts:
                p = p.strip()
                if p:
                    seen.setdefault(p, None)
    return list(seen)


def tokenizer() -> T.PreTrainedTokenizerBase:
    """The real MiniLM (bert-base-uncased vocabulary) tokenizer."""
    return T.AutoTokenizer.from_pretrained(resolve_checkpoint("minilm"))


class Vocab:
    """The MiniLM vocabulary restricted to the token ids that occur in the training corpus.

    Kept: the five special tokens and every MiniLM id seen at least ``min_count`` times in the packed training
    blocks, in MiniLM id order (so [PAD] [UNK] [CLS] [SEP] [MASK] become 0..4); every other id maps to [UNK].
    This only shrinks the embedding / decoder matrices (fewer parameters, cheaper decoder); the tokenisation itself
    is the MiniLM one.
    """

    def __init__(self, lookup: torch.Tensor, kept: torch.Tensor):
        self.lookup, self.kept = lookup, kept  # (30522,) old id -> new id; (size,) new id -> old id
        self.size = len(kept)
        self.pad, self.unk, self.cls, self.sep, self.mask = range(5)

    @classmethod
    def build(cls, train: torch.Tensor, tok, min_count: int) -> Vocab:
        """From the MiniLM-id training blocks ``train`` (n, SEQ)."""
        counts = torch.bincount(train.flatten(), minlength=tok.vocab_size)
        keep = counts >= min_count
        keep[[tok.convert_tokens_to_ids(t) for t in SPECIAL]] = True
        kept = keep.nonzero().flatten()
        lookup = torch.full((tok.vocab_size,), tok.convert_tokens_to_ids("[UNK]"), dtype=torch.long)
        lookup[kept] = kept
        lookup = torch.searchsorted(kept, lookup)  # old id -> position in ``kept``
        v = cls(lookup, kept)
        assert [v.lookup[tok.convert_tokens_to_ids(t)].item() for t in SPECIAL] == list(range(5))
        return v

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """MiniLM ids -> corpus-vocabulary ids (same shape)."""
        return self.lookup[ids]


def vocab(tok, min_count: int = 5) -> Vocab:
    """Cached :meth:`Vocab.build` on the training blocks (``WORK/vocab_min<min_count>.pt``)."""
    path = WORK / f"vocab_min{min_count}.pt"
    if not path.exists():
        v = Vocab.build(_cached_blocks("train", tok), tok, min_count)
        tmp = path.with_suffix(f".tmp{random.random()}")
        torch.save({"lookup": v.lookup, "kept": v.kept}, tmp)
        tmp.rename(path)
    d = torch.load(path)
    return Vocab(d["lookup"], d["kept"])


def _cached_blocks(split: str, tok) -> torch.Tensor:
    path = WORK / f"blocks_{split}.pt"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{random.random()}")
        torch.save(packed_blocks(split, tok, seed=1234), tmp)
        tmp.rename(path)
    return torch.load(path)


def blocks(split: str, tok, voc: Vocab) -> torch.Tensor:
    """Cached :func:`packed_blocks` (``WORK/blocks_<split>.pt``, MiniLM ids) in ``voc`` ids."""
    return voc(_cached_blocks(split, tok))


def packed_blocks(split: str, tok, seed: int = 0) -> torch.Tensor:
    """Texts of ``split`` shuffled, tokenised and packed into ``[CLS] ... [SEP]`` blocks of ``SEQ`` tokens.

    Returns:
        ``(n_blocks, SEQ)`` int64 token ids; sentences are separated by ``[SEP]``.
    """
    texts = _texts(split)
    random.Random(seed).shuffle(texts)
    ids: list[int] = []
    for i in range(0, len(texts), 2048):
        for row in tok(texts[i : i + 2048], add_special_tokens=False)["input_ids"]:
            ids.extend(row[: SEQ * 4])
            ids.append(tok.sep_token_id)
    body = SEQ - 2
    n = len(ids) // body
    x = torch.tensor(ids[: n * body], dtype=torch.long).view(n, body)
    cls = torch.full((n, 1), tok.cls_token_id, dtype=torch.long)
    sep = torch.full((n, 1), tok.sep_token_id, dtype=torch.long)
    return torch.cat([cls, x, sep], dim=1)


def mask_tokens(x: torch.Tensor, voc: Vocab, g: torch.Generator, p: float = 0.15) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT masking (80 % [MASK], 10 % random, 10 % kept) of non-special tokens (``voc`` ids).

    Returns:
        ``(inputs, labels)``; labels are -100 where no loss is taken.
    """
    special = (x == voc.cls) | (x == voc.sep) | (x == voc.pad)
    chosen = (torch.rand(x.shape, generator=g) < p) & ~special
    labels = torch.where(chosen, x, torch.full_like(x, -100))
    r = torch.rand(x.shape, generator=g)
    inputs = x.clone()
    inputs[chosen & (r < 0.8)] = voc.mask
    rnd = chosen & (r >= 0.8) & (r < 0.9)
    inputs[rnd] = torch.randint(5, voc.size, (int(rnd.sum()),), generator=g)  # no special tokens
    return inputs, labels


def mlm_loss(model: T.BertForMaskedLM, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean MLM cross-entropy, computing vocabulary logits only at the masked positions (saves ~2/3 compute)."""
    hidden = model.bert(input_ids=inputs, attention_mask=torch.ones_like(inputs)).last_hidden_state
    sel = labels != -100
    logits = model.cls(hidden[sel])  # (n_masked, vocab)
    return torch.nn.functional.cross_entropy(logits, labels[sel])


def new_model(seed: int, voc: Vocab, dropout: float = 0.0) -> T.BertForMaskedLM:
    """A fresh small BERT MLM (tied decoder, ``voc.size`` tokens) initialised from ``seed``."""
    cfg = T.BertConfig(
        vocab_size=voc.size,
        max_position_embeddings=SEQ,
        tie_word_embeddings=True,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        pad_token_id=voc.pad,
        **MODEL,
    )
    torch.manual_seed(seed)
    return T.BertForMaskedLM(cfg)


# ------------------------------------------------------------------------------------------- pretrain
def lr_factor(step: int, steps: int, warmup: int) -> float:
    """Linear warm-up over ``warmup`` steps, then linear decay to 0 at ``steps`` (a function of the step only)."""
    if step < warmup:
        return (step + 1) / warmup
    return max(0.0, (steps - step) / max(1, steps - warmup))


def optimizer_step(model: torch.nn.Module, opt: torch.optim.Optimizer, sched, loss: torch.Tensor) -> None:
    """One update of both training loops: backward, gradient norm clipped at 1, optimiser and schedule step."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()


def held_out_loss(model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor, device: str = "cpu") -> float:
    """Mean MLM loss over fixed masked held-out blocks (batches of 64 blocks, equal weight per batch)."""
    model.eval()
    with torch.no_grad():
        parts = [
            mlm_loss(model, inputs[i : i + 64].to(device), labels[i : i + 64].to(device)).item()
            for i in range(0, len(inputs), 64)
        ]
    return sum(parts) / len(parts)
