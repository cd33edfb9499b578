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
