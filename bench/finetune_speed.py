"""Fine-tuning throughput (train examples/s): a plain PyTorch loop vs symfuse's defaults, in one process.

Both fine-tunes use the same data, seed and hyper-parameters. The plain loop is what one writes by hand: shuffled
batches padded to their longest member and ``torch.optim.AdamW`` as PyTorch builds it (``length_buckets=None,
fused_optimizer=False``); symfuse's defaults add length-bucketed batches and the fused AdamW kernel. Each run prints
both examples/s, their ratio and both models' primary metric on the eval split; run ``i`` uses seed ``13 + i - 1``
(the same for both), so quality is compared over several seeds.

Usage: python bench/finetune_speed.py [--runs 5] [--train-examples 160] [--epochs 1] [--lr 1e-5] [--eval-examples 1000]
[--device cpu]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
from pathlib import Path

import torch

from symfuse.data import load_task_dataset
from symfuse.evaluate import evaluate_model
from symfuse.train import TRAIN_REPORT, FinetuneConfig, finetune


def _one(args, cfg: FinetuneConfig, tmp: Path, tag: str) -> tuple[float, float, str]:
    """Train examples/s and the eval primary metric (and its name) of one fine-tune with ``cfg``."""
    out = finetune(args.base, args.data, tmp / f"ft-{tag}", cfg, device=args.device)
    epochs = json.loads((out / TRAIN_REPORT).read_text())["epochs"]
    seen = sum(e["train_examples_per_s"] * e["train_seconds"] for e in epochs)
    speed = seen / sum(e["train_seconds"] for e in epochs)
    metrics = evaluate_model(
        out,
        args.data,
        split=args.eval_split,
        max_examples=args.eval_examples,
        max_length=args.max_length,
        device=args.device,
        out_file=tmp / f"m-{tag}.json",
    )
    return speed, metrics[metrics["primary"]], metrics["primary"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="minilm")
    ap.add_argument("--data", default="dair_emotion")
    ap.add_argument("--train-examples", type=int, default=160)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-length", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--eval-split", default="test")
    ap.add_argument("--eval-examples", type=int, default=None, help="subsample the eval split (seeded)")
    ap.add_argument("--runs", type=int, default=1, help="plain and length-bucketed fine-tunes per run")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    common = dict(
        epochs=args.epochs,
        lr=args.lr,
        batch_size=args.batch_size,
        max_length=args.max_length,
        max_train_examples=args.train_examples,
        max_eval_examples=64,
        progress=False,
    )
    plain_opts = dict(length_buckets=None, fused_optimizer=False)
    n_eval = len(load_task_dataset(args.data).split(args.eval_split))
    n_eval = min(n_eval, args.eval_examples or n_eval)
    print(f"base {args.base}, data {args.data}, device {args.device}, torch threads {torch.get_num_threads()}, "
          f"cpu count {os.cpu_count()}, batch {args.batch_size}, max length {args.max_length}, "
          f"train examples {args.train_examples}, epochs {args.epochs}, lr {args.lr}, "
          f"eval {args.eval_split} n={n_eval}")  # fmt: skip
    print("| run | plain ex/s | symfuse ex/s | ratio | plain metric | symfuse metric | load avg |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    ratios, scores = [], []
    for run in range(1, args.runs + 1):
        seed = 13 + run - 1
        with tempfile.TemporaryDirectory() as tmp:
            plain, plain_m, name = _one(args, FinetuneConfig(**common, **plain_opts, seed=seed), Path(tmp), "plain")
            fast, fast_m, _ = _one(args, FinetuneConfig(**common, seed=seed), Path(tmp), "fast")  # defaults
        ratios.append(fast / plain)
        scores.append((plain_m, fast_m))
        print(f"| {run} | {plain:.2f} | {fast:.2f} | {fast / plain:.2f} | {name} {plain_m:.4f} | {name} {fast_m:.4f} "
              f"| {os.getloadavg()[0]:.2f} |", flush=True)  # fmt: skip
    ratios.sort()
    print(
        f"ratio median {ratios[len(ratios) // 2]:.2f}, range {ratios[0]:.2f}-{ratios[-1]:.2f} over {len(ratios)} runs"
    )
    mean = [sum(s[i] for s in scores) / len(scores) for i in (0, 1)]
    print(f"{name}: plain mean {mean[0]:.4f}, symfuse mean {mean[1]:.4f} (difference {mean[1] - mean[0]:+.4f})")


if __name__ == "__main__":
    main()
