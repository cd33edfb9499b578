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
    args = p.parse_args()
    if args.stage == "prepare":
        tok = tokenizer()
        log.info("train %s held-out %s", tuple(blocks("train", tok).shape), tuple(blocks("validation", tok).shape))
    if args.stage == "pretrain":
        pretrain(args)


if __name__ == "__main__":
    main()
