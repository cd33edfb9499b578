"""Statistics collection throughput (tokens/s): Gram vs diagonal Fisher (batched and one example at a time).

MiniLM with a fresh 6-class head on dair_emotion's first examples; the same batches for every row.

Usage: python bench/stats_speed.py [--examples 64] [--batch-size 16] [--max-length 64] [--device cpu]
"""

from __future__ import annotations

import argparse
import logging
import os
import time

import torch
from transformers import AutoModelForSequenceClassification

from symfuse.checkpoint import default_base_model
from symfuse.data import make_batches
from symfuse.stats import collect_fisher, collect_gram
from symfuse.stats import fisher as fisher_mod


def _timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="dair_emotion")
    ap.add_argument("--examples", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-length", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    base = default_base_model()
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(str(base), num_labels=6).eval()
    batches = make_batches(args.data, base, "train", args.batch_size, args.max_length, args.examples)
    n_tokens = sum(int(b["attention_mask"].sum()) for b in batches)
    rows = []
    t, _ = _timed(lambda: collect_gram(model, batches, args.device, progress=False))
    rows.append(("gram", t))
    for mode in ("empirical", "sampled"):
        t, fast = _timed(lambda m=mode: collect_fisher(model, batches, m, device=args.device, progress=False))
        rows.append((f"fisher {mode} (batched)", t))
        original = fisher_mod.Recorder.usable
        fisher_mod.Recorder.usable = lambda self: False  # force the one-example-at-a-time fallback
        try:
            t, slow = _timed(lambda m=mode: collect_fisher(model, batches, m, device=args.device, progress=False))
        finally:
            fisher_mod.Recorder.usable = original
        rows.append((f"fisher {mode} (per-example loop)", t))
        # relative to each parameter's norm, floored at 1e-6 of the largest: parameters whose exact gradient is 0
        # (attention key biases: softmax is shift-invariant) hold float rounding noise only (~1e-24)
        floor = 1e-6 * max(float(v.norm()) for v in slow.fisher.values())
        err = max(float((fast.fisher[n] - slow.fisher[n]).norm()) / max(float(slow.fisher[n].norm()), floor)
                  for n in slow.fisher)  # fmt: skip
        rows.append((f"  max relative difference batched vs loop ({mode})", err))
    print(f"examples {args.examples}, tokens {n_tokens}, batch {args.batch_size}, max length {args.max_length}, "
          f"device {args.device}, torch threads {torch.get_num_threads()}, cpu count {os.cpu_count()}, "
          f"load avg (1 min) {os.getloadavg()[0]:.2f}")  # fmt: skip
    print(f"| {'statistic':<48} | {'seconds':>8} | {'tokens/s':>9} |")
    print(f"|{'-' * 50}|{'-' * 10}:|{'-' * 10}:|")
    for name, value in rows:
        if name.startswith("  "):
            print(f"| {name.strip():<48} | {value:>8.1e} | {'':>9} |")
        else:
            print(f"| {name:<48} | {value:>8.2f} | {n_tokens / value:>9.0f} |")


if __name__ == "__main__":
    main()
