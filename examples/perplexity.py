"""Perplexity of causal language models on a text dataset, and a greedy continuation (the SmolLM2 GGUF recipe).

    .venv/bin/python examples/perplexity.py M1 [M2 ...] [--data tinyshakespeare] [--split test] [--max-examples 64]

Each MODEL is a checkpoint folder or a .gguf file (read as every symfuse command reads it). The data is a dataset
folder (or a bare name found where symfuse finds datasets) holding ``<split>.jsonl`` records with a ``text`` field,
such as the shared tinyshakespeare (whose language-modelling task symfuse's task loaders do not read). Prints one
line per model: the perplexity over every predicted token of the first ``--max-examples`` records (each cut to
``--max-length`` tokens), and the greedy continuation of ``--prompt``.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from transformers import AutoTokenizer

from symfuse.checkpoint import load_hf_model, resolve_checkpoint
from symfuse.data.locate import find_named_dataset
from symfuse.device import resolve_device


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The script's options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="+", help="checkpoint folders or .gguf files")
    p.add_argument("--data", default="tinyshakespeare", help="dataset folder or name with <split>.jsonl texts")
    p.add_argument("--split", default="test", help="split file read: <split>.jsonl")
    p.add_argument("--max-examples", type=int, default=64, help="records read, from the start of the split")
    p.add_argument("--max-length", type=int, default=128, help="tokens per record at most")
    p.add_argument("--prompt", default="ROMEO:", help="text continued greedily by each model")
    p.add_argument("--new-tokens", type=int, default=12, help="tokens of the continuation")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    return p.parse_args(argv)


def read_texts(data: str, split: str, limit: int) -> list[str]:
    """The first ``limit`` non-empty ``text`` fields of ``<data>/<split>.jsonl``."""
    folder = Path(data) if Path(data).is_dir() else find_named_dataset(data)
    if folder is None or not (folder / f"{split}.jsonl").is_file():
        raise SystemExit(f"error: {data}: no {split}.jsonl found — give a dataset folder holding it")
    texts = []
    with open(folder / f"{split}.jsonl", encoding="utf-8") as fh:
        for line in fh:
            text = json.loads(line).get("text", "") if line.strip() else ""
            if text:
                texts.append(text)
            if len(texts) == limit:
                break
    return texts


@torch.no_grad()
def perplexity(model: torch.nn.Module, ids: list[torch.Tensor]) -> tuple[float, int]:
    """``exp`` of the mean next-token loss over every predicted token of ``ids``; the number of those tokens."""
    total, count = 0.0, 0
    for seq in ids:
        if seq.numel() < 2:
            continue
        logits = model(seq[None]).logits[0, :-1].float()
        total += torch.nn.functional.cross_entropy(logits, seq[1:], reduction="sum").item()
        count += seq.numel() - 1
    return math.exp(total / count), count


def main(argv: list[str] | None = None) -> int:
    """Print each model's perplexity and continuation; return 0."""
    args = parse_args(argv)
    device = resolve_device(args.device, "--device")
    texts = read_texts(args.data, args.split, args.max_examples)
    for name in args.models:
        folder = resolve_checkpoint(name)
        tok = AutoTokenizer.from_pretrained(str(folder))
        model = load_hf_model(folder, dtype=torch.float32).to(device)
        ids = [tok(t, return_tensors="pt", truncation=True, max_length=args.max_length)["input_ids"][0].to(device)
               for t in texts]  # fmt: skip
        ppl, tokens = perplexity(model, ids)
        prompt = tok(args.prompt, return_tensors="pt").to(device)
        out = model.generate(**prompt, max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=tok.eos_token_id)
        text = tok.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
        print(
            f"{name}: perplexity {ppl:.1f} on {tokens} tokens of {args.data}/{args.split}; {args.prompt!r} -> {text!r}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
