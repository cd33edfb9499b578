"""Fine-tuning throughput (examples/s) and full-evaluation time for MiniLM on this machine.

Usage: python bench/finetune_speed.py [--train-examples 160] [--data dair_emotion] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import time
from pathlib import Path

import torch

from symfuse.data import load_task_dataset
from symfuse.evaluate import evaluate_model
from symfuse.train import TRAIN_REPORT, FinetuneConfig, finetune


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="minilm")
    ap.add_argument("--data", default="dair_emotion")
    ap.add_argument("--train-examples", type=int, default=160)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-length", type=int, default=64)
    ap.add_argument("--eval-split", default="test")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    cfg = FinetuneConfig(
        epochs=1,
        lr=1e-5,
        batch_size=args.batch_size,
        max_length=args.max_length,
        max_train_examples=args.train_examples,
        max_eval_examples=64,
        progress=False,
    )
    with tempfile.TemporaryDirectory() as tmp:
        out = finetune(args.base, args.data, Path(tmp) / "ft", cfg, device=args.device)
        epoch = json.loads((out / TRAIN_REPORT).read_text())["epochs"][0]
        n_eval = len(load_task_dataset(args.data).split(args.eval_split))
        t0 = time.perf_counter()
        metrics = evaluate_model(
            out,
            args.data,
            split=args.eval_split,
            max_length=args.max_length,
            device=args.device,
            out_file=Path(tmp) / "m.json",
        )
        eval_s = time.perf_counter() - t0
    rows = [
        ("base", args.base),
        ("data", args.data),
        ("device", args.device),
        ("torch threads", torch.get_num_threads()),
        ("cpu count", os.cpu_count()),
        ("load avg (1 min)", f"{os.getloadavg()[0]:.2f}"),
        ("batch size", args.batch_size),
        ("max length (dynamic padding)", args.max_length),
        ("train examples", args.train_examples),
        ("train seconds", f"{epoch['train_seconds']:.1f}"),
        ("train examples/s", f"{epoch['train_examples_per_s']:.2f}"),
        (f"full eval ({args.eval_split}, n={n_eval}, batch 64) seconds", f"{eval_s:.1f}"),
        ("eval examples/s", f"{n_eval / eval_s:.1f}"),
        (f"eval {metrics['primary']}", f"{metrics[metrics['primary']]:.4f}"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


if __name__ == "__main__":
    main()
