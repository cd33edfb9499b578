"""A tiny random BERT that uses the real MiniLM tokenizer (fast stand-in for the MiniLM base in tests)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import transformers as T

from symfuse.checkpoint import resolve_checkpoint

TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def save_tiny_base(folder: Path, seed: int = 0) -> Path:
    """A 2-layer, 32-wide BertModel with MiniLM's 30522-token vocabulary and tokenizer files."""
    cfg = T.BertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=128,
    )
    torch.manual_seed(seed)
    T.BertModel(cfg).save_pretrained(folder)
    src = resolve_checkpoint("minilm")
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy2(src / name, Path(folder) / name)
    return Path(folder)


def no_validation_dataset(folder: Path, n_train: int = 20) -> Path:
    """A classification folder with ``train.jsonl`` and ``test.jsonl`` and NO ``validation.jsonl``.

    Train is three quarters joy, one quarter anger (distinct texts); test holds the same kind of texts with the labels
    FLIPPED (mostly anger), so once a model has learned anything (the majority class, at least) its loss on test is
    far from its loss on train records: a model picked on test is told apart.
    """
    import json

    folder.mkdir(parents=True, exist_ok=True)
    words = {"joy": ["happy", "glad", "cheerful", "delighted"], "anger": ["angry", "furious", "mad", "annoyed"]}

    def row(prefix: str, i: int, flip: bool) -> dict:
        label = "anger" if i % 4 == 3 else "joy"
        gold = {"joy": "anger", "anger": "joy"}[label] if flip else label
        return {"text": f"{prefix} {i}: i feel so {words[label][i % 4]}", "label": gold}

    rows = [row("record", i, flip=False) for i in range(n_train)]
    flipped = [row("test", i, flip=True) for i in range(8)]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in flipped))
    (folder / "meta.json").write_text(json.dumps({"task": "classification", "labels": ["anger", "joy"]}))
    return folder
