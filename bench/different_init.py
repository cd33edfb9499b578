"""Different-initialisation loss-barrier experiment (issue 5).

Two small BERT-style MLM models are pre-trained from scratch from two seeds on the text of the shared datasets;
then the MLM loss on held-out text is measured along the linear path between them after aligning model B to
model A by: nothing (plain averaging), weight-based permutations, activation-based permutations
(FFN + heads + residual stream), activation-based permutations + rotation + scaling, and OT fusion
(``symfuse.match.ot``, issue 16: EMD on weights and on activations, and soft entropic OT, which is not exact).
Finally both are fine-tuned on one emotion dataset and the midpoint accuracy is reported for each method.

Stages (each reads / writes under ``bench/out/different_init``)::

    python bench/different_init.py prepare                              # tokenise, pack, build the corpus vocabulary
    python bench/different_init.py pretrain --seed 0 --steps 3000       # one process per seed (run 2 in parallel)
    python bench/different_init.py pretrain --seed 1 --steps 3000
    python bench/different_init.py evaluate                             # align, interpolate, fine-tune, write results

Pre-training is purely step-based (learning rate, data order and masking depend on the step number only), so a
run may be paused (SIGSTOP / SIGCONT) or slowed by other jobs without changing its result.

Code: this file (pre-training, command line), ``different_init_corpus.py`` (text, vocabulary, packed blocks,
model, MLM loss) and ``different_init_eval.py`` (alignment, interpolation, fine-tuning, results).

This is a benchmark, not a test: it prints a table and writes ``bench/results/different_init.{md,json,png}``.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch
from different_init_corpus import (  # a sibling: bench scripts run from bench/
    RESULTS,
    SEQ,
    WORK,
    blocks,
    held_out_loss,
    lr_factor,
    mask_tokens,
    mlm_loss,
    new_model,
    optimizer_step,
    tokenizer,
    vocab,
)
from different_init_eval import evaluate

log = logging.getLogger("different_init")


def pretrain(args: argparse.Namespace) -> None:
    """Pre-train one model with MLM for exactly ``args.steps`` steps (schedule, data and masking depend on steps)."""
    torch.set_num_threads(args.threads)
    out = args.out or WORK / f"pretrain_seed{args.seed}"
    tok = tokenizer()
    voc = vocab(tok, args.min_count)
    data = blocks("train", tok, voc)  # same data for both seeds: only the init and the batch order differ
    held = blocks("validation", tok, voc)[: args.eval_blocks]
    log.info(
        "seed %d: %d train blocks, %d held-out blocks of %d tokens, vocabulary %d, %d steps of batch %d",
        args.seed,
        len(data),
        len(held),
        SEQ,
        voc.size,
        args.steps,
        args.batch,
    )
    model = new_model(args.seed, voc, args.dropout)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98), eps=1e-6)
    warmup = max(1, round(args.warmup * args.steps))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, args.steps, warmup))
    g = torch.Generator().manual_seed(args.seed + 100)
    held_in, held_lab = mask_tokens(held, voc, torch.Generator().manual_seed(777))
    order = torch.randperm(len(data), generator=g)
    pos, history, t0, train_losses = 0, [], time.time(), []
    out.mkdir(parents=True, exist_ok=True)
    cfg = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    (out / "run.json").write_text(json.dumps(cfg, indent=1))
    stop = min(args.steps, args.stop_after or args.steps)  # a truncated run of the same schedule
    for step in range(stop):
        if pos + args.batch > len(order):
            order, pos = torch.randperm(len(data), generator=g), 0
        x = data[order[pos : pos + args.batch]]
        pos += args.batch
        inputs, labels = mask_tokens(x, voc, g)
        model.train()
        loss = mlm_loss(model, inputs.to(device), labels.to(device))
        optimizer_step(model, opt, sched, loss)
        train_losses.append(loss.item())
        last = step == stop - 1
        if (step + 1) % args.eval_every == 0 or step == 0 or last:
            elapsed = time.time() - t0
            hl = held_out_loss(model, held_in, held_lab, device)
            rec = {
                "step": step + 1,
                "seconds": round(elapsed, 1),
                "lr": sched.get_last_lr()[0],
                "train_loss": sum(train_losses) / len(train_losses),  # mean since the previous record
                "held_loss": hl,
            }
            history.append(rec)
            train_losses = []
            log.info(
                "seed %d step %d/%d (%.0fs, %.3f step/s): train %.3f held %.3f lr %.2e",
                args.seed,
                step + 1,
                args.steps,
                elapsed,
                (step + 1) / elapsed,
                rec["train_loss"],
                hl,
                rec["lr"],
            )
            model.save_pretrained(out)  # safetensors written in place; the last save is the final model
            (out / "history.json").write_text(json.dumps(history, indent=1))
    log.info("seed %d done: %d of %d steps in %.0fs", args.seed, stop, args.steps, time.time() - t0)


def main() -> None:
    """Command-line entry point (see the module docstring)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="stage", required=True)
    pt = sub.add_parser("pretrain")
    pt.add_argument("--seed", type=int, required=True)
    pt.add_argument("--steps", type=int, default=3000, help="total optimiser steps (the schedule depends on it)")
    pt.add_argument(
        "--stop-after",
        type=int,
        default=None,
        help="stop after this many steps of the --steps schedule (the learning rate is then not annealed)",
    )
    pt.add_argument("--batch", type=int, default=64)
    pt.add_argument("--lr", type=float, default=1e-3)
    pt.add_argument("--warmup", type=float, default=0.06, help="warm-up fraction of the steps")
    pt.add_argument("--dropout", type=float, default=0.0)
    pt.add_argument("--min-count", type=int, default=5, help="corpus vocabulary: ids seen at least this often")
    pt.add_argument("--threads", type=int, default=1)
    pt.add_argument("--eval-every", type=int, default=100)
    pt.add_argument("--eval-blocks", type=int, default=512)
    pt.add_argument("--out", type=Path, default=None, help="default bench/out/different_init/pretrain_seed<SEED>")
    pr = sub.add_parser("prepare", help="tokenise and cache the packed train / held-out blocks and the vocabulary")
    pr.add_argument("--min-count", type=int, default=5)
    ev = sub.add_parser("evaluate", help="align, interpolate, fine-tune, write bench/results/different_init.*")
    ev.add_argument("--points", type=int, default=21)
    ev.add_argument("--eval-blocks", type=int, default=128)
    ev.add_argument("--stat-blocks", type=int, default=128)
    ev.add_argument("--threads", type=int, default=2)
    ev.add_argument("--ft-examples", type=int, default=8000)
    ev.add_argument("--ft-epochs", type=int, default=3)
    ev.add_argument("--ft-lr", type=float, default=3e-4)
    ev.add_argument("--ft-batch", type=int, default=32)
    ev.add_argument("--ft-dropout", type=float, default=0.1)
    ev.add_argument("--ft-eval", type=int, default=2000)
    ev.add_argument("--ot-reg", type=float, default=0.05, help="entropic regularisation of the soft OT rows")
    ev.add_argument("--results", type=Path, default=RESULTS, help="output folder (default bench/results)")
    args = p.parse_args()
    if args.stage == "prepare":
        tok = tokenizer()
        voc = vocab(tok, args.min_count)
        tr, va = blocks("train", tok, voc), blocks("validation", tok, voc)
        log.info(
            "train %s held-out %s, vocabulary %d of %d", tuple(tr.shape), tuple(va.shape), voc.size, tok.vocab_size
        )
        log.info(
            "[UNK] share: train %.4f, held-out %.4f", (tr == voc.unk).float().mean(), (va == voc.unk).float().mean()
        )
    if args.stage == "pretrain":
        pretrain(args)
    if args.stage == "evaluate":
        evaluate(args)


if __name__ == "__main__":
    main()
