"""Different-initialisation loss-barrier experiment (issue 5).

Two small BERT-style MLM models are pre-trained from scratch from two seeds on the text of the shared datasets;
then the MLM loss on held-out text is measured along the linear path between them after aligning model B to
model A by: nothing (plain averaging), weight-based permutations, activation-based permutations
(FFN + heads + residual stream), activation-based permutations + rotation + scaling, either permutation + the
per-head invertible maps of ``head-linear`` (issue 32), and OT fusion
(``symfuse.match.ot``, issue 16: EMD on weights and on activations, and soft entropic OT, which is not exact).
Finally both are fine-tuned on one emotion dataset and the midpoint accuracy is reported for each method.

Stages (each reads / writes under ``bench/out/different_init``)::

    python bench/different_init.py prepare                              # tokenise, pack, build the corpus vocabulary
    python bench/different_init.py pretrain --seed 0 --steps 3000       # one process per seed (run 2 in parallel)
    python bench/different_init.py pretrain --seed 1 --steps 3000
    python bench/different_init.py evaluate                             # align, interpolate, fine-tune, write results

Pre-training is purely step-based (learning rate, data order and masking depend on the step number only), so a
run may be paused (SIGSTOP / SIGCONT) or slowed by other jobs without changing its result. It is also resumable
across processes: every save (every ``--eval-every`` steps) also writes ``resume.safetensors`` in the output folder
(weights, AdamW moments and step counts, the data generator's state, the epoch order and position, the RNG; the
scheduler state, history and run options as JSON in the file's metadata), atomically (temp file + ``os.replace``).
Running the same ``pretrain`` command again continues from it (``--resume`` insists on it), bitwise identical to an
uninterrupted run; a state written under other options is refused (remove ``resume.safetensors`` to start over).

Code: this file (pre-training, command line), ``different_init_corpus.py`` (text, vocabulary, packed blocks,
model, MLM loss) and ``different_init_eval.py`` (alignment, interpolation, fine-tuning, results).

This is a benchmark, not a test: it prints a table and writes ``bench/results/different_init.{md,json,png}``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
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
from safetensors import safe_open
from safetensors.torch import save_file

log = logging.getLogger("different_init")


STATE = "resume.safetensors"  # the resume state, in the output folder
# the options that define a pre-training run's result, bit for bit (--stop-after and --out do not); the thread count
# does (it changes the order of float reductions), and so does the device (recorded next to these in the state)
RUN_KEYS = ("seed", "steps", "batch", "lr", "warmup", "dropout", "min_count", "eval_every", "eval_blocks", "threads")


class ResumeError(Exception):
    """A resume state that cannot be used with this command (one line: what, why, the fix)."""


def _replace_write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (a temp sibling, then ``os.replace``)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _save_model(model: torch.nn.Module, out: Path) -> None:
    """``save_pretrained`` into a temp folder, then each file moved into ``out`` with ``os.replace``."""
    tmp = out / f".save.tmp{os.getpid()}"
    model.save_pretrained(tmp)
    for f in sorted(tmp.iterdir()):
        os.replace(f, out / f.name)
    tmp.rmdir()


def write_resume(path: Path, model, opt, sched, g: torch.Generator, order: torch.Tensor, meta: dict) -> None:
    """The resume state after ``meta["step"]`` steps as ONE safetensors file (JSON in its metadata), atomically.

    Tensors: the parameters (``model.*``), the AdamW state (``opt.<index>.{exp_avg,exp_avg_sq,step}``), the data
    generator's state, the epoch order and torch's RNG states. ``meta`` (step, position in the order, history,
    options) and the scheduler state and learning rates go into the ``state`` metadata entry.
    """
    tensors = {f"model.{n}": p.detach().to("cpu").contiguous() for n, p in model.named_parameters()}
    opt_sd, scalars = opt.state_dict(), {}
    for idx, st in opt_sd["state"].items():
        for key, value in st.items():
            if torch.is_tensor(value):
                tensors[f"opt.{idx}.{key}"] = value.detach().to("cpu").contiguous()
            else:
                scalars[f"{idx}.{key}"] = value
    tensors |= {"data.generator": g.get_state(), "data.order": order.contiguous(), "rng.cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    sched_sd = {k: v for k, v in sched.state_dict().items() if k != "lr_lambdas"}
    lrs = [grp["lr"] for grp in opt_sd["param_groups"]]
    state = {**meta, "scheduler": sched_sd, "lrs": lrs, "optimizer_scalars": scalars}
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    save_file(tensors, tmp, metadata={"state": json.dumps(state)})
    os.replace(tmp, path)


def read_resume(path: Path, model, opt, sched, g: torch.Generator, config: dict) -> tuple[torch.Tensor, dict]:
    """Restore :func:`write_resume`'s state into ``model``, ``opt``, ``sched``, ``g`` and torch's RNG.

    Returns:
        ``(order, meta)``.

    Raises:
        ResumeError: the state was written by a run with other options.
    """
    with safe_open(path, "pt") as f:
        meta = json.loads(f.metadata()["state"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)
    if meta["config"] != config:
        diff = sorted(k for k in config.keys() | meta["config"].keys() if config.get(k) != meta["config"].get(k))
        raise ResumeError(
            f"{path}: written by a run with other options ({', '.join(diff)}) — repeat that run's command, or "
            "remove the file to start over"
        )
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(tensors[f"model.{n}"])
    state: dict[int, dict] = {}
    opt_items = {k[4:]: v for k, v in tensors.items() if k.startswith("opt.")} | meta.pop("optimizer_scalars")
    for key, value in opt_items.items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = value
    groups = opt.state_dict()["param_groups"]  # same options, same parameter order: only the lr moved
    for grp, lr in zip(groups, meta.pop("lrs"), strict=True):
        grp["lr"] = lr
    opt.load_state_dict({"state": state, "param_groups": groups})
    sched.load_state_dict({**meta.pop("scheduler"), "lr_lambdas": [None] * len(groups)})
    g.set_state(tensors["data.generator"])
    torch.set_rng_state(tensors["rng.cpu"])
    if "rng.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng.cuda"])
    return tensors["data.order"], meta


def pretrain(args: argparse.Namespace) -> None:
    """Pre-train one model with MLM for exactly ``args.steps`` steps (schedule, data and masking depend on steps).

    Resumes from ``resume.safetensors`` in the output folder when it is there (see the module docstring).

    Raises:
        ResumeError: ``--resume`` without a state, a state of other options, or one past ``--stop-after``.
    """
    torch.set_num_threads(args.threads)
    out = args.out or WORK / f"pretrain_seed{args.seed}"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = {k: getattr(args, k) for k in RUN_KEYS} | {"device": device}
    stop = min(args.steps, args.stop_after or args.steps)  # a truncated run of the same schedule
    if args.resume and not (out / STATE).exists():
        raise ResumeError(f"{out / STATE}: no resume state — run without --resume to start this run")
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
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98), eps=1e-6)
    warmup = max(1, round(args.warmup * args.steps))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, args.steps, warmup))
    g = torch.Generator().manual_seed(args.seed + 100)
    held_in, held_lab = mask_tokens(held, voc, torch.Generator().manual_seed(777))
    order = torch.randperm(len(data), generator=g)
    meta = {"step": 0, "pos": 0, "history": [], "seconds": 0.0, "resumed_at": [], "config": config}
    if (out / STATE).exists():
        order, meta = read_resume(out / STATE, model, opt, sched, g, config)
        if meta["step"] > stop:
            raise ResumeError(
                f"{out / STATE}: the run is at step {meta['step']}, past --stop-after {stop} — raise --stop-after"
            )
        meta["resumed_at"].append(meta["step"])
        log.info("seed %d: resuming at step %d from %s", args.seed, meta["step"], out / STATE)
    pos, history, start, train_losses = meta["pos"], meta["history"], meta["step"], []
    base_seconds, t0 = meta["seconds"], time.time()  # seconds of the earlier processes; this one's start
    out.mkdir(parents=True, exist_ok=True)
    cfg = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    _replace_write(out / "run.json", json.dumps({**cfg, "resumed_at": meta["resumed_at"]}, indent=1))
    for step in range(start, stop):
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
            now = time.time() - t0
            hl = held_out_loss(model, held_in, held_lab, device)
            rec = {
                "step": step + 1,
                "seconds": round(base_seconds + now, 1),  # summed over the processes of a resumed run
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
                rec["seconds"],
                (step + 1 - start) / now,  # this process's rate
                rec["train_loss"],
                hl,
                rec["lr"],
            )
            _save_model(model, out)  # the last save is the final model
            _replace_write(out / "history.json", json.dumps(history, indent=1))
            meta |= {"step": step + 1, "pos": pos, "history": history, "seconds": rec["seconds"]}
            write_resume(out / STATE, model, opt, sched, g, order, meta)
    log.info("seed %d done: %d of %d steps (%d in this process)", args.seed, stop, args.steps, stop - start)


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
    pt.add_argument(
        "--resume",
        action="store_true",
        help="insist on continuing from OUT/resume.safetensors (without it: continued when present, else started)",
    )
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
        try:
            pretrain(args)
        except ResumeError as e:
            sys.exit(f"error: {e}")
    if args.stage == "evaluate":
        evaluate(args)


if __name__ == "__main__":
    main()
