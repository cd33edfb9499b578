"""Train small GPT-2 models from different seeds on Tiny Shakespeare (the training half of the LMC benchmark).

Setting of Theus et al., "Generalized Linear Mode Connectivity for Transformers" (NeurIPS 2025): GPT-2, 6 layers,
d 256, 4 heads, MLP 1024, AdamW 3e-4 (betas 0.9 / 0.95, weight decay 0.01 on every 2-D tensor: the attention and MLP
weights and the tied token and position embeddings; none on biases and LayerNorms), linear warm-up then cosine decay
to 10 % of the learning rate, batches of 32 random windows of 256 tokens, gradients clipped at 1.0, early stopping on
the validation loss with patience 5 evaluations. Depends on torch, transformers, tokenizers and safetensors only
(it runs where symfuse is not installed)::

    python bench/lmc_train.py tokenizer --out bench/results/lmc/tokenizer.json   # byte-level BPE, 4096, train split
    python bench/lmc_train.py train --seed 0 --out RUNS/seed0 [--d-model 256 --heads 4] [--save-dtype float16]
    python bench/lmc_train.py all --out RUNS --seeds 0 1 2 [--wide-seed 3]        # RUNS/seed<N>, RUNS/wide<N>

A run writes its folder whole or not at all (HF ``save_pretrained`` of the best model, ``tokenizer.json``,
``train_log.json``); it checkpoints into ``RUNS/.seed0.state/`` (safetensors + JSON, no pickle) and the same command
resumes from there. Data: ``--data DIR`` with ``{train,validation,test}.jsonl`` (``{"text": speech}`` per line); the
default is the shared copy when it exists, else ``bench/data/tinyshakespeare`` (identical files, see its meta.json).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
import shlex
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file
from tokenizers import ByteLevelBPETokenizer, Tokenizer
from transformers import GPT2Config, GPT2LMHeadModel

HERE = Path(__file__).resolve().parent
SHARED_DATA = Path("/work/shared/datasets/tinyshakespeare")
DATA = SHARED_DATA if SHARED_DATA.is_dir() else HERE / "data" / "tinyshakespeare"
TOKENIZER = HERE / "results" / "lmc" / "tokenizer.json"
SPLITS = ("train", "validation", "test")
SEQ, BATCH, VOCAB, LAYERS = 256, 32, 4096, 6  # BATCH: the default training batch and the eval batch
SAVE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
log = logging.getLogger("lmc_train")


class UsageError(Exception):
    """A bad command line or output folder: reported as one ``error:`` line, exit 2."""


def read_split(data: Path, split: str) -> str:
    """One split's speeches joined with blank lines (the text the token stream is made of)."""
    with open(data / f"{split}.jsonl", encoding="utf-8") as f:
        return "\n\n".join(json.loads(line)["text"] for line in f if line.strip())


def build_tokenizer(data: Path) -> Tokenizer:
    """Train the byte-level BPE (vocabulary 4096) on the train split only; deterministic."""
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        [read_split(data, "train")], vocab_size=VOCAB, min_frequency=2, special_tokens=["<|endoftext|>"],
        show_progress=False,
    )  # fmt: skip
    return bpe._tokenizer


def token_stream(tok: Tokenizer, data: Path, split: str, max_tokens: int | None = None) -> torch.Tensor:
    """The split as one int64 token stream, optionally cut to its first ``max_tokens`` tokens."""
    ids = torch.tensor(tok.encode(read_split(data, split)).ids, dtype=torch.int64)
    return ids[:max_tokens] if max_tokens else ids


def new_model(d_model: int, heads: int, dropout: float, seed: int) -> GPT2LMHeadModel:
    """A freshly initialised GPT-2 (6 layers, MLP 4 d, tied embeddings); seeds torch's global RNG first."""
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=d_model, n_layer=LAYERS, n_head=heads, n_inner=4 * d_model,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, tie_word_embeddings=True,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def lr_at(step: int, lr: float, warmup: int, max_steps: int) -> float:
    """Learning rate of the 0-based ``step``: linear warm-up, then cosine decay to ``lr / 10`` at ``max_steps``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    return lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * progress)))


def new_optimizer(model: torch.nn.Module, lr: float, weight_decay: float, fused: bool) -> torch.optim.AdamW:
    """AdamW with weight decay on the 2-D tensors (weights, embeddings) and none on biases and LayerNorms."""
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=fused)


def sample_batch(stream: torch.Tensor, size: int, gen: torch.Generator, device: torch.device):
    """``size`` random windows of 257 tokens: inputs (size, 256) and targets shifted by one."""
    start = torch.randint(len(stream) - SEQ, (size,), generator=gen)
    windows = stream[start[:, None] + torch.arange(SEQ + 1)]  # (size, 257)
    if device.type == "cuda":
        windows = windows.pin_memory().to(device, non_blocking=True)
    return windows[:, :-1], windows[:, 1:]


def lm_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (computed in float32 whatever the autocast)."""
    logits = model(input_ids=x, use_cache=False).logits  # (batch, seq, vocab)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


@torch.no_grad()
def eval_loss(model: torch.nn.Module, stream: torch.Tensor, device: torch.device) -> float:
    """Mean loss over all non-overlapping 256-token windows of ``stream``, in eval mode (no dropout), no autocast."""
    n = (len(stream) - 1) // SEQ
    x, y = stream[: n * SEQ].view(n, SEQ), stream[1 : n * SEQ + 1].view(n, SEQ)
    was_training, total = model.training, 0.0
    model.eval()
    for i in range(0, n, BATCH):
        xb, yb = x[i : i + BATCH].to(device), y[i : i + BATCH].to(device)
        total += lm_loss(model, xb, yb).item() * len(xb)
    model.train(was_training)
    return total / n


def resolve_device(spec: str) -> torch.device:
    """``auto`` (CUDA when present), ``cpu``, ``cuda`` or ``cuda:N``; a CUDA device that is not there is an error.

    Raises:
        UsageError: the device is malformed or not on this machine.
    """
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", spec):
        raise UsageError(f"--device {spec}: not a device — use auto, cpu, cuda or cuda:N")
    device, count = torch.device(spec), torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.type == "cuda" and (device.index or 0) >= count:
        raise UsageError(f"--device {spec}: no such CUDA device (this machine has {count}) — use --device cpu")
    return device


def params_cpu(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """CPU copies of the parameters (the tied ``lm_head.weight`` appears once, as ``transformer.wte.weight``)."""
    return {name: p.detach().to("cpu", copy=True) for name, p in model.named_parameters()}


@torch.no_grad()
def load_params(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy ``tensors`` (from :func:`params_cpu`) into the model's parameters in place."""
    for name, p in model.named_parameters():
        p.copy_(tensors[name])


def write_state(path: Path, model, opt, best: dict, gen: torch.Generator, meta: dict) -> None:
    """Write the resumable state into ``path`` atomically (a sibling is written, then swapped in)."""
    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(params_cpu(model), tmp / "model.safetensors")
    save_file(best, tmp / "best.safetensors")
    opt_sd, opt_tensors, opt_scalars = opt.state_dict(), {}, {}
    for idx, state in opt_sd["state"].items():
        for key, value in state.items():
            if torch.is_tensor(value):
                opt_tensors[f"{idx}.{key}"] = value.detach().to("cpu").contiguous()
            else:
                opt_scalars[f"{idx}.{key}"] = value
    save_file(opt_tensors, tmp / "optimizer.safetensors")
    rngs = {"data": gen.get_state(), "torch_cpu": torch.get_rng_state()}  # dropout draws from torch's own RNGs
    if next(model.parameters()).is_cuda:
        rngs["torch_cuda"] = torch.cuda.get_rng_state(next(model.parameters()).device)
    save_file(rngs, tmp / "rng.safetensors")
    (tmp / "state.json").write_text(json.dumps({**meta, "optimizer_scalars": opt_scalars}))
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)


def read_state(
    path: Path, model, opt, gen: torch.Generator, config: dict
) -> tuple[dict[str, torch.Tensor], dict] | None:
    """Restore model, optimizer and RNGs from :func:`write_state`'s folder; returns (best weights, meta) or None.

    Raises:
        UsageError: the state was written by a run with another ``config``.
    """
    old = path.with_name(path.name + ".old")
    path = path if path.exists() else old if old.exists() else None  # killed between the two renames
    if path is None:
        return None
    meta = json.loads((path / "state.json").read_text())
    if meta["config"] != config:
        raise UsageError(f"{path}: state of a run with other options — remove it or repeat that command")
    load_params(model, load_file(path / "model.safetensors"))
    state: dict[int, dict] = {}
    for key, value in {**load_file(path / "optimizer.safetensors"), **meta.pop("optimizer_scalars")}.items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = value
    opt.load_state_dict({"state": state, "param_groups": opt.state_dict()["param_groups"]})  # same groups, same order
    rngs = load_file(path / "rng.safetensors")
    gen.set_state(rngs["data"])
    torch.set_rng_state(rngs["torch_cpu"])
    if "torch_cuda" in rngs:
        torch.cuda.set_rng_state(rngs["torch_cuda"], next(model.parameters()).device)
    return load_file(path / "best.safetensors"), meta


def run_config(args: argparse.Namespace) -> dict:
    """The options that define a run's result (a state written under other options is not resumed)."""
    keys = ("seed", "d_model", "heads", "dropout", "lr", "weight_decay", "warmup", "max_steps", "batch_size",
            "eval_every", "patience", "max_train_tokens", "save_dtype")  # fmt: skip
    return {k: getattr(args, k) for k in keys} | {"data": str(args.data), "tokenizer": str(args.tokenizer)}


def check_out(out: Path, overwrite: bool) -> None:
    """Refuse to replace an existing output folder unless ``overwrite``."""
    if out.exists() and not overwrite:
        raise UsageError(f"{out}: exists — remove it or pass --overwrite")


def train(args: argparse.Namespace, device: torch.device) -> dict | None:
    """Train one model (resuming from its state folder), save the best one to ``args.out``; returns its log.

    Returns None when ``--stop-after-steps`` stopped the run early (a debug stand-in for a killed process).
    """
    out, t0 = Path(args.out), time.perf_counter()
    check_out(out, args.overwrite)
    streams = load_streams(args)
    cuda = device.type == "cuda"
    torch.backends.cuda.matmul.allow_tf32 = cuda
    model = new_model(args.d_model, args.heads, args.dropout, args.seed).to(device)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    log.info("%s: d %d, %d heads, %d parameters, %s", out, args.d_model, args.heads, n_params, device)
    opt = new_optimizer(model, args.lr, args.weight_decay, fused=cuda)
    gen = torch.Generator().manual_seed(args.seed)  # the data's own generator
    state_dir, config = out.with_name(f".{out.name}.state"), run_config(args)
    meta = {"step": 0, "best_val": math.inf, "best_step": 0, "bad_evals": 0, "evals": [], "seconds": 0.0,
            "resumed_at": [], "config": config}  # fmt: skip
    best = params_cpu(model)
    restored = read_state(state_dir, model, opt, gen, config)
    if restored:
        best, meta = restored
        meta["resumed_at"].append(meta["step"])
        log.info("resuming %s at step %d", out, meta["step"])
    start_step, t_loop, base_s = meta["step"], time.perf_counter(), meta["seconds"]
    loss_sum, loss_n = torch.zeros((), device=device), 0
    while meta["step"] < args.max_steps and meta["bad_evals"] < args.patience:
        for group in opt.param_groups:
            group["lr"] = lr_at(meta["step"], args.lr, args.warmup, args.max_steps)
        x, y = sample_batch(streams["train"], args.batch_size, gen, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = lm_loss(model, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_sum += loss.detach()
        meta["step"], loss_n = meta["step"] + 1, loss_n + 1
        if meta["step"] % args.eval_every == 0 or meta["step"] == args.max_steps:
            meta["seconds"] = base_s + time.perf_counter() - t_loop
            evaluate_step(model, streams["validation"], device, meta, best, loss_sum.item() / loss_n)
            loss_sum, loss_n = torch.zeros_like(loss_sum), 0
            if len(meta["evals"]) % args.checkpoint_every == 0:
                write_state(state_dir, model, opt, best, gen, meta)
        if args.stop_after_steps and meta["step"] >= args.stop_after_steps:
            log.info("stopped at step %d (--stop-after-steps)", meta["step"])
            return None
    loop_s = time.perf_counter() - t_loop
    tmp = save_best(out, model, best, args.save_dtype, args.tokenizer)
    result = describe(args, tmp, meta, streams, device)
    wall_s = time.perf_counter() - t0
    result |= {"steps_per_s": (meta["step"] - start_step) / max(loop_s, 1e-9), "wall_s": wall_s,
               "seconds": base_s + wall_s}  # fmt: skip
    save_output(out, tmp, result, args.overwrite)
    shutil.rmtree(state_dir, ignore_errors=True)
    return result


def load_streams(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """The three token streams (train cut to ``--max-train-tokens``).

    Raises:
        UsageError: a stream is shorter than one window.
    """
    tok = Tokenizer.from_file(str(args.tokenizer))
    streams = {s: token_stream(tok, args.data, s, args.max_train_tokens if s == "train" else None) for s in SPLITS}
    for split, ids in streams.items():
        if len(ids) <= SEQ + 1:
            raise UsageError(f"{args.data}: {split} has {len(ids)} tokens, fewer than one window of {SEQ + 1}")
    return streams


def evaluate_step(model, val_ids, device, meta: dict, best: dict, train_loss: float) -> None:
    """One evaluation: log it, keep the best weights in ``best`` (in place), count evaluations without progress."""
    val = eval_loss(model, val_ids, device)
    meta["evals"].append({"step": meta["step"], "train_loss": train_loss, "val_loss": val, "seconds": meta["seconds"]})
    if val < meta["best_val"]:
        meta.update(best_val=val, best_step=meta["step"], bad_evals=0)
        best.update(params_cpu(model))
    else:
        meta["bad_evals"] += 1
    log.info("step %5d  train %.4f  val %.4f  best %.4f@%d  %.0f s", meta["step"], train_loss, val,
             meta["best_val"], meta["best_step"], meta["seconds"])  # fmt: skip


def save_best(out: Path, model, best: dict, save_dtype: str, tokenizer: Path) -> Path:
    """Save the best weights, rounded once to ``save_dtype``, and the tokenizer into a temp sibling of ``out``."""
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    load_params(model, best)
    model.to(SAVE_DTYPES[save_dtype]).save_pretrained(tmp)
    shutil.copyfile(tokenizer, tmp / "tokenizer.json")
    return tmp


def describe(args, tmp: Path, meta: dict, streams: dict, device: torch.device) -> dict:
    """The run's log; validation and test losses are those of the saved file, in float32 (TF32 off)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    saved = GPT2LMHeadModel.from_pretrained(tmp, dtype=torch.float32).to(device)
    return {
        "command": args.command_line, "config": meta["config"], "seed": args.seed,
        "device": str(device), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__,
        "tokens": {split: len(ids) for split, ids in streams.items()},
        "parameters": sum(p.numel() for p in saved.parameters()),
        "weight_decay_on": "2-D tensors (attention / MLP weights, token and position embeddings)",
        "evals": meta["evals"], "steps": meta["step"], "best_step": meta["best_step"],
        "best_val_loss": meta["best_val"], "saved_val_loss": eval_loss(saved, streams["validation"], device),
        "test_loss": eval_loss(saved, streams["test"], device), "stopped_early": meta["bad_evals"] >= args.patience,
        "resumed_at": meta["resumed_at"],
    }  # fmt: skip


def save_output(out: Path, tmp: Path, result: dict, overwrite: bool) -> None:
    """Write ``train_log.json`` into ``tmp`` and rename it to ``out`` (replacing ``out`` only with ``overwrite``)."""
    (tmp / "train_log.json").write_text(json.dumps(result, indent=1) + "\n")
    check_out(out, overwrite)
    old = out.with_name(f".{out.name}.old")
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def cmd_tokenizer(args: argparse.Namespace) -> None:
    """Build the tokenizer, write it atomically and print each split's token count."""
    tok = build_tokenizer(args.data)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    tmp.replace(out)
    for split in SPLITS:
        print(f"{split:10s} {len(token_stream(tok, args.data, split)):8d} tokens")
    print(f"wrote {out} ({out.stat().st_size} bytes)")


def cmd_train(args: argparse.Namespace) -> None:
    """Train one seed and print its summary."""
    result = train(args, resolve_device(args.device))
    if result:
        print_table([(f"seed{args.seed}", result)])


def cmd_all(args: argparse.Namespace) -> None:
    """Train every seed (and the wide model) not yet in ``--out``, one after another, then print the table."""
    device, root, rows = resolve_device(args.device), Path(args.out), []
    runs = [(f"seed{s}", s, args.d_model, args.heads) for s in args.seeds]
    if args.wide_seed is not None:
        runs.append((f"wide{args.wide_seed}", args.wide_seed, 2 * args.d_model, 2 * args.heads))
    for name, seed, d_model, heads in runs:
        run_args = argparse.Namespace(**vars(args) | {"seed": seed, "d_model": d_model, "heads": heads})
        run_args.out = root / name
        if run_args.out.exists() and not args.overwrite:
            log.info("%s: finished, skipped", run_args.out)
        elif train(run_args, device) is None:
            return
        rows.append((name, json.loads((run_args.out / "train_log.json").read_text())))
    print_table(rows)


def print_table(rows: list[tuple[str, dict]]) -> None:
    """Print one line per run: best step, steps, validation and test loss of the file, steps/s, seconds in all."""
    print(f"{'run':8s} {'best':>6s} {'steps':>6s} {'val':>7s} {'test':>7s} {'steps/s':>8s} {'seconds':>8s}")
    for name, r in rows:
        print(f"{name:8s} {r['best_step']:6d} {r['steps']:6d} {r['saved_val_loss']:7.4f} {r['test_loss']:7.4f} "
              f"{r['steps_per_s']:8.2f} {r['seconds']:8.1f}")  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (``tokenizer``, ``train``, ``all``)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--data", type=Path, default=DATA, help="folder of {train,validation,test}.jsonl")
    common.add_argument("--tokenizer", type=Path, default=TOKENIZER)
    common.add_argument("--d-model", type=int, default=256)
    common.add_argument("--heads", type=int, default=4)
    common.add_argument("--dropout", type=float, default=0.1)
    common.add_argument("--lr", type=float, default=3e-4)
    common.add_argument("--weight-decay", type=float, default=0.01)
    common.add_argument("--warmup", type=int, default=100)
    common.add_argument("--max-steps", type=int, default=5000)
    common.add_argument("--batch-size", type=int, default=BATCH)
    common.add_argument("--eval-every", type=int, default=100)
    common.add_argument("--patience", type=int, default=5)
    common.add_argument("--checkpoint-every", type=int, default=1, help="evaluations between resumable states")
    common.add_argument("--max-train-tokens", type=int, default=None, help="cut the train stream (tests)")
    common.add_argument("--save-dtype", choices=sorted(SAVE_DTYPES), default="float32")
    common.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    common.add_argument("--overwrite", action="store_true")
    common.add_argument("--stop-after-steps", type=int, default=None, help="debug: stop at this step, as if killed")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    tok = sub.add_parser("tokenizer", help="build the BPE tokenizer from the train split")
    tok.add_argument("--data", type=Path, default=DATA)
    tok.add_argument("--out", type=Path, default=TOKENIZER)
    one = sub.add_parser("train", parents=[common], help="train one seed")
    one.add_argument("--seed", type=int, required=True)
    one.add_argument("--out", type=Path, required=True)
    many = sub.add_parser("all", parents=[common], help="train several seeds (and one wide model)")
    many.add_argument("--out", type=Path, required=True)
    many.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    many.add_argument("--wide-seed", type=int, default=None, help="also train d 2x / heads 2x into OUT/wide<seed>")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point: one ``error:`` line and exit 2 for a usage error."""
    script, argv = (sys.argv[0], sys.argv[1:]) if argv is None else (__file__, argv)
    args = parse_args(argv)
    args.command_line = shlex.join([Path(sys.executable).name, script, *argv])
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    transformers.utils.logging.disable_progress_bar()
    try:
        {"tokenizer": cmd_tokenizer, "train": cmd_train, "all": cmd_all}[args.command](args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
