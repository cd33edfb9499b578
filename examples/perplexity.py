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

from symfuse.cli.boundary import run_script
from symfuse.data.locate import find_named_dataset
from symfuse.device import resolve_device
from symfuse.errors import DataError, UsageError
from symfuse.evaluate.language import load_causal_lm, mean_next_token_loss


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
    file = None if folder is None else folder / f"{split}.jsonl"
    if file is None or not file.is_file():
        raise UsageError(f"{data}: no {split}.jsonl found — give a dataset folder holding it")
    texts = []
    with open(file, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            try:
                record = json.loads(line) if line.strip() else {}
            except ValueError as exc:
                raise DataError(f"{file}:{number}: not valid JSON ({exc}) — fix the line") from exc
            text = record.get("text") if isinstance(record, dict) else None
            if isinstance(text, str) and text:
                texts.append(text)
            if len(texts) == limit:
                break
    if not texts:
        raise DataError(f'{file}: no record with a non-empty "text" string — give a split of texts')
    return texts


def main(argv: list[str] | None = None) -> int:
    """Print each model's perplexity and continuation; return 0."""
    args = parse_args(argv)
    if args.max_examples < 1 or args.max_length < 2 or args.new_tokens < 0:
        raise UsageError("--max-examples must be >= 1, --max-length >= 2 and --new-tokens >= 0")
    device = resolve_device(args.device, "--device")
    texts = read_texts(args.data, args.split, args.max_examples)
    for name in args.models:
        model, tok = load_causal_lm(name, device)  # a classifier or a bare encoder: one line naming it
        loss, tokens = mean_next_token_loss(model, tok, texts, name, device, max_length=args.max_length)
        prompt = tok(args.prompt, return_tensors="pt").to(device)
        with torch.no_grad():
            out = model.generate(**prompt, max_new_tokens=args.new_tokens, do_sample=False,
                                 pad_token_id=tok.pad_token_id)  # fmt: skip
        text = tok.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
        print(f"{name}: perplexity {math.exp(loss):.1f} on {tokens} tokens of {args.data}/{args.split}; "
              f"{args.prompt!r} -> {text!r}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(run_script(main))
