"""Different-initialisation loss-barrier experiment (issue 5).

Two small BERT-style MLM models are pre-trained from scratch from two seeds on the text of the shared datasets;
then the MLM loss on held-out text is measured along the linear path between them after aligning model B to
model A by: nothing (plain averaging), weight-based permutations, activation-based permutations
(FFN + heads + residual stream), and activation-based permutations + rotation + scaling. Finally both are
fine-tuned on one emotion dataset and the midpoint accuracy is reported for each method.

Stages (each reads / writes under ``--work``, default ``bench/out/different_init``)::

    python bench/different_init.py pretrain --seed 0 --minutes 45      # one process per seed (run 2 in parallel)
    python bench/different_init.py pretrain --seed 1 --minutes 45
    python bench/different_init.py evaluate                            # align, interpolate, fine-tune, write results

This is a benchmark, not a test: it prints a table and writes ``bench/results/different_init.{md,json,png}``.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import random
import time
from pathlib import Path

import torch
import transformers as T

from symfuse.checkpoint import resolve_checkpoint

log = logging.getLogger("different_init")

DATASETS = Path("/work/shared/datasets")
WORK = Path("bench/out/different_init")
RESULTS = Path("bench/results")
SEQ = 64
# d 128 rather than 256: one CPU thread does ~1 step/s of 64x64 tokens at this size (3x faster than d 256),
# so the models see ~3x more text within the same wall-time budget.
MODEL = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, intermediate_size=512)


# ------------------------------------------------------------------------------------------------ data
def _texts(split: str) -> list[str]:
    """Every text of every shared dataset's ``split`` (token lists joined), deduplicated, in a fixed order."""
    seen: dict[str, None] = {}
    for f in sorted(DATASETS.glob(f"*/{split}.jsonl")):
        for line in f.read_text().splitlines():
            row = json.loads(line)
            parts = [row[k] for k in ("text", "text_pair") if isinstance(row.get(k), str)]
            if isinstance(row.get("tokens"), list):
                parts.append(" ".join(row["tokens"]))
            for p in parts:
                p = p.strip()
                if p:
                    seen.setdefault(p, None)
    return list(seen)


def tokenizer() -> T.PreTrainedTokenizerBase:
    """The real MiniLM (bert-base-uncased vocabulary) tokenizer."""
    return T.AutoTokenizer.from_pretrained(resolve_checkpoint("minilm"))


def blocks(split: str, tok) -> torch.Tensor:
    """Cached :func:`packed_blocks` (``WORK/blocks_<split>.pt``) so that parallel processes tokenise once."""
    path = WORK / f"blocks_{split}.pt"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{random.random()}")
        torch.save(packed_blocks(split, tok, seed=1234), tmp)
        tmp.rename(path)
    return torch.load(path)


def packed_blocks(split: str, tok, seed: int = 0) -> torch.Tensor:
    """Texts of ``split`` shuffled, tokenised and packed into ``[CLS] ... [SEP]`` blocks of ``SEQ`` tokens.

    Returns:
        ``(n_blocks, SEQ)`` int64 token ids; sentences are separated by ``[SEP]``.
    """
    texts = _texts(split)
    random.Random(seed).shuffle(texts)
    ids: list[int] = []
    for i in range(0, len(texts), 2048):
        for row in tok(texts[i : i + 2048], add_special_tokens=False)["input_ids"]:
            ids.extend(row[: SEQ * 4])
            ids.append(tok.sep_token_id)
    body = SEQ - 2
    n = len(ids) // body
    x = torch.tensor(ids[: n * body], dtype=torch.long).view(n, body)
    cls = torch.full((n, 1), tok.cls_token_id, dtype=torch.long)
    sep = torch.full((n, 1), tok.sep_token_id, dtype=torch.long)
    return torch.cat([cls, x, sep], dim=1)


def mask_tokens(x: torch.Tensor, tok, g: torch.Generator, p: float = 0.15) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT masking (80 % [MASK], 10 % random, 10 % kept) of non-special tokens.

    Returns:
        ``(inputs, labels)``; labels are -100 where no loss is taken.
    """
    special = (x == tok.cls_token_id) | (x == tok.sep_token_id) | (x == tok.pad_token_id)
    chosen = (torch.rand(x.shape, generator=g) < p) & ~special
    labels = torch.where(chosen, x, torch.full_like(x, -100))
    r = torch.rand(x.shape, generator=g)
    inputs = x.clone()
    inputs[chosen & (r < 0.8)] = tok.mask_token_id
    rnd = chosen & (r >= 0.8) & (r < 0.9)
    inputs[rnd] = torch.randint(999, tok.vocab_size, (int(rnd.sum()),), generator=g)  # skip [unused*] ids
    return inputs, labels


def mlm_loss(model: T.BertForMaskedLM, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean MLM cross-entropy, computing vocabulary logits only at the masked positions (saves ~2/3 compute)."""
    hidden = model.bert(input_ids=inputs, attention_mask=torch.ones_like(inputs)).last_hidden_state
    sel = labels != -100
    logits = model.cls(hidden[sel])  # (n_masked, vocab)
    return torch.nn.functional.cross_entropy(logits, labels[sel])


def new_model(seed: int, tok) -> T.BertForMaskedLM:
    """A fresh small BERT MLM (tied decoder) initialised from ``seed``."""
    cfg = T.BertConfig(
        vocab_size=tok.vocab_size,
        max_position_embeddings=SEQ,
        tie_word_embeddings=True,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
        **MODEL,
    )
    torch.manual_seed(seed)
    return T.BertForMaskedLM(cfg)


# ------------------------------------------------------------------------------------------- pretrain
def pretrain(args: argparse.Namespace) -> None:
    """Pre-train one model with MLM for a fixed number of steps (or until the time budget runs out)."""
    torch.set_num_threads(args.threads)
    out = WORK / f"pretrain_seed{args.seed}"
    tok = tokenizer()
    data = blocks("train", tok)  # same data for both seeds: only the init and the batch order differ
    held = blocks("validation", tok)[: args.eval_blocks]
    log.info("seed %d: %d train blocks, %d held-out blocks of %d tokens", args.seed, len(data), len(held), SEQ)
    model = new_model(args.seed, tok)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    g = torch.Generator().manual_seed(args.seed + 100)
    geval = torch.Generator().manual_seed(777)
    held_in, held_lab = mask_tokens(held, tok, geval)
    # linear warm-up (5 %) and linear decay over the run's progress = max(step / steps, elapsed / budget), so the
    # schedule anneals fully even when the shared CPU is slower than expected
    steps, budget, t0 = args.steps, args.minutes * 60, time.time()

    def progress(step: int) -> float:
        return max(step / steps, (time.time() - t0) / budget)

    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, progress(s) / 0.05 + 1e-3) * max(0.02, 1 - progress(s))
    )
    order = torch.randperm(len(data), generator=g)
    pos, history = 0, []
    for step in range(steps):
        if pos + args.batch > len(order):
            order, pos = torch.randperm(len(data), generator=g), 0
        x = data[order[pos : pos + args.batch]]
        pos += args.batch
        inputs, labels = mask_tokens(x, tok, g)
        model.train()
        loss = mlm_loss(model, inputs.to(device), labels.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        elapsed = time.time() - t0
        last = step == steps - 1 or elapsed > budget
        if step % args.eval_every == 0 or last:
            model.eval()
            with torch.no_grad():
                hl = sum(
                    mlm_loss(model, held_in[i : i + 64].to(device), held_lab[i : i + 64].to(device)).item()
                    for i in range(0, len(held_in), 64)
                ) / math.ceil(len(held_in) / 64)
            history.append({"step": step, "seconds": round(elapsed, 1), "train_loss": loss.item(), "held_loss": hl})
            log.info(
                "seed %d step %d (%.0fs, %.2f step/s): train %.3f held %.3f lr %.2e",
                args.seed,
                step,
                elapsed,
                (step + 1) / elapsed,
                loss.item(),
                hl,
                sched.get_last_lr()[0],
            )
            model.save_pretrained(out)
            tok.save_pretrained(out)
            (out / "history.json").write_text(json.dumps(history, indent=1))
        if last:
            break
    log.info("seed %d done: %d steps in %.0fs", args.seed, step + 1, time.time() - t0)


# ------------------------------------------------------------------------------------------- alignment
METHODS = ("plain", "weight_permutation", "activation_permutation", "full", "weight_full")
LABELS = {
    "plain": "plain averaging",
    "weight_permutation": "weight-based permutations (FFN + heads)",
    "activation_permutation": "activation-based permutations (FFN + heads + residual)",
    "full": "activation permutations + rotation + scaling",
    "weight_full": "weight-based permutations + rotation + scaling (extra)",
}


def align(method: str, source: torch.nn.Module, anchor: torch.nn.Module, batches: list) -> dict[str, torch.Tensor]:
    """SOURCE's state dict aligned to ANCHOR by ``method`` (one of :data:`METHODS`); same function as SOURCE."""
    from symfuse.arch import get_spec
    from symfuse.match.activation import match_activations
    from symfuse.match.weights import match_module_weights

    if method == "plain":
        return {k: v.clone() for k, v in source.state_dict().items()}
    if method in ("activation_permutation", "full"):
        syms = ("residual-permutation", "head-permutation", "ffn-permutation")
        syms += ("rotation", "scaling") if method == "full" else ()
        return match_activations(source, anchor, batches, symmetries=syms).state
    syms = ("ffn-permutation", "head-permutation") + (("rotation", "scaling") if method == "weight_full" else ())
    spec, cfg = get_spec(source.config), source.config
    geo = spec.geometry(cfg)
    st, an = dict(source.state_dict()), anchor.state_dict()
    prefix = spec.detect_prefix(st)
    for ref in spec.modules(cfg):
        s = spec.read_module(st.__getitem__, st.__contains__, ref, cfg, prefix)
        a = spec.read_module(an.__getitem__, an.__contains__, ref, cfg, prefix)
        st.update(spec.write_module(match_module_weights(ref, s, a, geo, syms).apply(s), ref, cfg, prefix))
    return st


def _stat_batches(data: torch.Tensor, n_blocks: int, batch: int = 32) -> list[dict[str, torch.Tensor]]:
    x = data[:n_blocks]
    return [
        {"input_ids": x[i : i + batch], "attention_mask": torch.ones_like(x[i : i + batch])}
        for i in range(0, len(x), batch)
    ]


def _check_same_function(a: torch.nn.Module, state: dict, batch: dict) -> float:
    b = copy.deepcopy(a)
    b.load_state_dict(state)
    with torch.no_grad():
        return float((a.eval()(**batch).logits - b.eval()(**batch).logits).abs().max())


# ------------------------------------------------------------------------------------------- fine-tune
def _emotion(split: str, tok, cap: int | None) -> tuple[dict[str, torch.Tensor], torch.Tensor, list[str]]:
    rows = [json.loads(line) for line in (DATASETS / "dair_emotion" / f"{split}.jsonl").read_text().splitlines()]
    labels = json.loads((DATASETS / "dair_emotion" / "meta.json").read_text())["labels"]
    rows = rows[:cap] if cap else rows
    enc = tok([r["text"] for r in rows], padding=True, truncation=True, max_length=SEQ, return_tensors="pt")
    y = torch.tensor([labels.index(r["label"]) for r in rows])
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}, y, labels


def finetune(pre: Path, out: Path, seed: int, tok, args: argparse.Namespace) -> T.BertForSequenceClassification:
    """Fine-tune a pre-trained MLM folder on dair_emotion (capped), or load it when ``out`` exists."""
    if (out / "config.json").exists():
        return T.BertForSequenceClassification.from_pretrained(out).eval()
    x, y, labels = _emotion("train", tok, args.ft_examples)
    torch.manual_seed(seed)
    model = T.BertForSequenceClassification.from_pretrained(pre, num_labels=len(labels))
    opt = torch.optim.AdamW(model.parameters(), lr=args.ft_lr, weight_decay=0.01)
    steps = args.ft_epochs * math.ceil(len(y) / 32)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / (steps // 10 + 1)) * (1 - s / steps))
    g = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(args.ft_epochs):
        for idx in torch.randperm(len(y), generator=g).split(32):
            loss = model(input_ids=x["input_ids"][idx], attention_mask=x["attention_mask"][idx], labels=y[idx]).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    model.eval()
    model.save_pretrained(out)
    log.info("fine-tuned %s -> %s (%d steps, last loss %.3f)", pre, out, steps, loss.item())
    return model


def accuracy(model: torch.nn.Module, x: dict, y: torch.Tensor) -> float:
    """Accuracy on pre-encoded inputs."""
    with torch.no_grad():
        pred = torch.cat(
            [model(**{k: v[i : i + 256] for k, v in x.items()}).logits.argmax(-1) for i in range(0, len(y), 256)]
        )
    return float((pred == y).float().mean())


# ------------------------------------------------------------------------------------------- evaluate
def evaluate(args: argparse.Namespace) -> None:
    """Align B to A by every method, MLM loss along each path, fine-tuned midpoint accuracy; write results."""
    from symfuse.evaluate.barrier import barrier_from_losses, default_lambdas, interpolate_state, interpolation_losses

    torch.set_num_threads(args.threads)
    t0 = time.time()
    tok = tokenizer()
    a = T.BertForMaskedLM.from_pretrained(WORK / "pretrain_seed0").eval()
    b = T.BertForMaskedLM.from_pretrained(WORK / "pretrain_seed1").eval()
    train, held = blocks("train", tok), blocks("validation", tok)
    held_in, held_lab = mask_tokens(held[: args.eval_blocks], tok, torch.Generator().manual_seed(777))
    stat_batches = _stat_batches(train, args.stat_blocks)
    lambdas = default_lambdas(args.points)

    def held_loss(model: torch.nn.Module) -> float:
        with torch.no_grad():
            parts = [mlm_loss(model, held_in[i : i + 64], held_lab[i : i + 64]) for i in range(0, len(held_in), 64)]
        return float(sum(parts) / len(parts))

    results: dict = {"config": {k: v for k, v in vars(args).items() if k != "func"}, "model": MODEL, "mlm": {}}
    for name in ("pretrain_seed0", "pretrain_seed1"):
        hist = json.loads((WORK / name / "history.json").read_text())
        results[name] = {"steps": hist[-1]["step"] + 1, "seconds": hist[-1]["seconds"], "history": hist}
    probe = {"input_ids": held[:4], "attention_mask": torch.ones_like(held[:4])}
    aligned = {}
    for m in METHODS:
        t = time.time()
        aligned[m] = align(m, b, a, stat_batches)
        diff = _check_same_function(b, aligned[m], probe)
        losses = interpolation_losses(a, aligned[m], held_loss, lambdas, template=a)
        bar = barrier_from_losses(lambdas, losses)
        results["mlm"][m] = {
            "losses": losses,
            "max_abs_logit_diff_vs_B": diff,
            "align_seconds": round(time.time() - t, 1),
            **bar,
        }
        log.info(
            "%-24s barrier %.4f (midpoint loss %.4f, |Δlogits| %.1e)", m, bar["barrier"], losses[len(losses) // 2], diff
        )
    for m in ("weight_permutation", "activation_permutation", "full"):
        results[f"barrier_{m}"] = results["mlm"][m]["barrier"]
    results["barrier_plain"] = results["mlm"]["plain"]["barrier"]
    results["barrier_weight_full"] = results["mlm"]["weight_full"]["barrier"]
    # fine-tuned: accuracy of the midpoint model
    if args.ft_examples > 0:
        fa = finetune(WORK / "pretrain_seed0", WORK / "ft_seed0", 0, tok, args)
        fb = finetune(WORK / "pretrain_seed1", WORK / "ft_seed1", 1, tok, args)
        vx, vy, _ = _emotion("validation", tok, args.ft_eval)
        sx = _emotion("train", tok, args.stat_blocks * 2)[0]  # statistics inputs: emotion training texts
        ft_batches = [{k: v[i : i + 32] for k, v in sx.items()} for i in range(0, len(sx["input_ids"]), 32)]
        ft = {"acc_A": accuracy(fa, vx, vy), "acc_B": accuracy(fb, vx, vy), "midpoint": {}}
        for m in METHODS:
            st = align(m, fb, fa, ft_batches)
            mid = copy.deepcopy(fa)
            mid.load_state_dict(interpolate_state(fa.state_dict(), st, 0.5))
            ft["midpoint"][m] = accuracy(mid.eval(), vx, vy)
            log.info("fine-tuned midpoint %-24s accuracy %.4f", m, ft["midpoint"][m])
        results["finetuned"] = ft
    results["seconds"] = round(time.time() - t0, 1)
    write_results(results, lambdas)


def write_results(results: dict, lambdas: list[float]) -> None:
    """Write ``bench/results/different_init.{json,png}`` and the table part of the markdown; print the table."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "different_init.json").write_text(json.dumps(results, indent=1))
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for m in METHODS:
        ax.plot(lambdas, results["mlm"][m]["losses"], "o-", ms=3, label=LABELS[m])
    ax.set_xlabel("λ  (0 = model A, 1 = aligned model B)")
    ax.set_ylabel("held-out MLM loss")
    ax.set_title("Two BERT-style MLMs from different seeds: interpolation path", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / "different_init.png", dpi=120)
    plt.close(fig)
    plain = results["barrier_plain"]
    lines = [
        "| method | MLM loss barrier | reduction vs plain | midpoint MLM loss | fine-tuned midpoint acc. |",
        "|---|---|---|---|---|",
    ]
    for m in METHODS:
        r = results["mlm"][m]
        acc = results.get("finetuned", {}).get("midpoint", {}).get(m)
        red = 1 - r["barrier"] / plain if plain else float("nan")
        lines.append(
            f"| {LABELS[m]} | {r['barrier']:.4f} | {100 * red:.1f} % | {r['losses'][len(r['losses']) // 2]:.4f} | "
            + (f"{acc:.4f}" if acc is not None else "n/a")
            + " |"
        )
    table = "\n".join(lines)
    (RESULTS / "different_init_table.md").write_text(table + "\n")
    print(table)


def main() -> None:
    """Command-line entry point (see the module docstring)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="stage", required=True)
    pt = sub.add_parser("pretrain")
    pt.add_argument("--seed", type=int, required=True)
    pt.add_argument("--steps", type=int, default=100000)
    pt.add_argument("--minutes", type=float, default=45.0)
    pt.add_argument("--batch", type=int, default=64)
    pt.add_argument("--lr", type=float, default=1e-3)
    pt.add_argument("--threads", type=int, default=1)
    pt.add_argument("--eval-every", type=int, default=250)
    pt.add_argument("--eval-blocks", type=int, default=512)
    sub.add_parser("prepare", help="tokenise and cache the packed train / held-out blocks")
    ev = sub.add_parser("evaluate", help="align, interpolate, fine-tune, write bench/results/different_init.*")
    ev.add_argument("--points", type=int, default=21)
    ev.add_argument("--eval-blocks", type=int, default=128)
    ev.add_argument("--stat-blocks", type=int, default=128)
    ev.add_argument("--threads", type=int, default=2)
    ev.add_argument("--ft-examples", type=int, default=4000)
    ev.add_argument("--ft-epochs", type=int, default=2)
    ev.add_argument("--ft-lr", type=float, default=1e-4)
    ev.add_argument("--ft-eval", type=int, default=2000)
    args = p.parse_args()
    if args.stage == "prepare":
        tok = tokenizer()
        log.info("train %s held-out %s", tuple(blocks("train", tok).shape), tuple(blocks("validation", tok).shape))
    if args.stage == "pretrain":
        pretrain(args)
    if args.stage == "evaluate":
        evaluate(args)


if __name__ == "__main__":
    main()
