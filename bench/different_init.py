"""Different-initialisation loss-barrier experiment (issue 5).

Two small BERT-style MLM models are pre-trained from scratch from two seeds on the text of the shared datasets;
then the MLM loss on held-out text is measured along the linear path between them after aligning model B to
model A by: nothing (plain averaging), weight-based permutations, activation-based permutations
(FFN + heads + residual stream), and activation-based permutations + rotation + scaling. Finally both are
fine-tuned on one emotion dataset and the midpoint accuracy is reported for each method.

Stages (each reads / writes under ``bench/out/different_init``)::

    python bench/different_init.py prepare                              # tokenise, pack, build the corpus vocabulary
    python bench/different_init.py pretrain --seed 0 --steps 3000       # one process per seed (run 2 in parallel)
    python bench/different_init.py pretrain --seed 1 --steps 3000
    python bench/different_init.py evaluate                             # align, interpolate, fine-tune, write results

Pre-training is purely step-based (learning rate, data order and masking depend on the step number only), so a
run may be paused (SIGSTOP / SIGCONT) or slowed by other jobs without changing its result.

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
# d 128 rather than 256: ~3x cheaper per step on one CPU thread, so the models see ~3x more text per hour.
MODEL = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, intermediate_size=512)
SPECIAL = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")  # MiniLM ids 0, 100, 101, 102, 103 -> new ids 0..4


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


class Vocab:
    """The MiniLM vocabulary restricted to the token ids that occur in the training corpus.

    Kept: the five special tokens and every MiniLM id seen at least ``min_count`` times in the packed training
    blocks, in MiniLM id order (so [PAD] [UNK] [CLS] [SEP] [MASK] become 0..4); every other id maps to [UNK].
    This only shrinks the embedding / decoder matrices (fewer parameters, cheaper decoder); the tokenisation itself
    is the MiniLM one.
    """

    def __init__(self, lookup: torch.Tensor, kept: torch.Tensor):
        self.lookup, self.kept = lookup, kept  # (30522,) old id -> new id; (size,) new id -> old id
        self.size = len(kept)
        self.pad, self.unk, self.cls, self.sep, self.mask = range(5)

    @classmethod
    def build(cls, train: torch.Tensor, tok, min_count: int) -> Vocab:
        """From the MiniLM-id training blocks ``train`` (n, SEQ)."""
        counts = torch.bincount(train.flatten(), minlength=tok.vocab_size)
        keep = counts >= min_count
        keep[[tok.convert_tokens_to_ids(t) for t in SPECIAL]] = True
        kept = keep.nonzero().flatten()
        lookup = torch.full((tok.vocab_size,), tok.convert_tokens_to_ids("[UNK]"), dtype=torch.long)
        lookup[kept] = kept
        lookup = torch.searchsorted(kept, lookup)  # old id -> position in ``kept``
        v = cls(lookup, kept)
        assert [v.lookup[tok.convert_tokens_to_ids(t)].item() for t in SPECIAL] == list(range(5))
        return v

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """MiniLM ids -> corpus-vocabulary ids (same shape)."""
        return self.lookup[ids]


def vocab(tok, min_count: int = 5) -> Vocab:
    """Cached :meth:`Vocab.build` on the training blocks (``WORK/vocab_min<min_count>.pt``)."""
    path = WORK / f"vocab_min{min_count}.pt"
    if not path.exists():
        v = Vocab.build(_cached_blocks("train", tok), tok, min_count)
        tmp = path.with_suffix(f".tmp{random.random()}")
        torch.save({"lookup": v.lookup, "kept": v.kept}, tmp)
        tmp.rename(path)
    d = torch.load(path)
    return Vocab(d["lookup"], d["kept"])


def _cached_blocks(split: str, tok) -> torch.Tensor:
    path = WORK / f"blocks_{split}.pt"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{random.random()}")
        torch.save(packed_blocks(split, tok, seed=1234), tmp)
        tmp.rename(path)
    return torch.load(path)


def blocks(split: str, tok, voc: Vocab) -> torch.Tensor:
    """Cached :func:`packed_blocks` (``WORK/blocks_<split>.pt``, MiniLM ids) in ``voc`` ids."""
    return voc(_cached_blocks(split, tok))


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


def mask_tokens(x: torch.Tensor, voc: Vocab, g: torch.Generator, p: float = 0.15) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT masking (80 % [MASK], 10 % random, 10 % kept) of non-special tokens (``voc`` ids).

    Returns:
        ``(inputs, labels)``; labels are -100 where no loss is taken.
    """
    special = (x == voc.cls) | (x == voc.sep) | (x == voc.pad)
    chosen = (torch.rand(x.shape, generator=g) < p) & ~special
    labels = torch.where(chosen, x, torch.full_like(x, -100))
    r = torch.rand(x.shape, generator=g)
    inputs = x.clone()
    inputs[chosen & (r < 0.8)] = voc.mask
    rnd = chosen & (r >= 0.8) & (r < 0.9)
    inputs[rnd] = torch.randint(5, voc.size, (int(rnd.sum()),), generator=g)  # no special tokens
    return inputs, labels


def mlm_loss(model: T.BertForMaskedLM, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean MLM cross-entropy, computing vocabulary logits only at the masked positions (saves ~2/3 compute)."""
    hidden = model.bert(input_ids=inputs, attention_mask=torch.ones_like(inputs)).last_hidden_state
    sel = labels != -100
    logits = model.cls(hidden[sel])  # (n_masked, vocab)
    return torch.nn.functional.cross_entropy(logits, labels[sel])


def new_model(seed: int, voc: Vocab, dropout: float = 0.0) -> T.BertForMaskedLM:
    """A fresh small BERT MLM (tied decoder, ``voc.size`` tokens) initialised from ``seed``."""
    cfg = T.BertConfig(
        vocab_size=voc.size,
        max_position_embeddings=SEQ,
        tie_word_embeddings=True,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        pad_token_id=voc.pad,
        **MODEL,
    )
    torch.manual_seed(seed)
    return T.BertForMaskedLM(cfg)


# ------------------------------------------------------------------------------------------- pretrain
def lr_factor(step: int, steps: int, warmup: int) -> float:
    """Linear warm-up over ``warmup`` steps, then linear decay to 0 at ``steps`` (a function of the step only)."""
    if step < warmup:
        return (step + 1) / warmup
    return max(0.0, (steps - step) / max(1, steps - warmup))


def held_out_loss(model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor, device: str = "cpu") -> float:
    """Mean MLM loss over fixed masked held-out blocks (batches of 64 blocks, equal weight per batch)."""
    model.eval()
    with torch.no_grad():
        parts = [
            mlm_loss(model, inputs[i : i + 64].to(device), labels[i : i + 64].to(device)).item()
            for i in range(0, len(inputs), 64)
        ]
    return sum(parts) / len(parts)


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
    for step in range(args.steps):
        if pos + args.batch > len(order):
            order, pos = torch.randperm(len(data), generator=g), 0
        x = data[order[pos : pos + args.batch]]
        pos += args.batch
        inputs, labels = mask_tokens(x, voc, g)
        model.train()
        loss = mlm_loss(model, inputs.to(device), labels.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        train_losses.append(loss.item())
        last = step == args.steps - 1
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
    log.info("seed %d done: %d steps in %.0fs", args.seed, args.steps, time.time() - t0)


def stability(history: list[dict], tail: float = 0.2) -> dict:
    """Relative change of the held-out loss over the last ``tail`` fraction of the steps.

    Returns:
        ``{"from_step", "to_step", "loss_from", "loss_to", "rel_change"}`` where ``rel_change`` is
        ``(loss_from - loss_to) / loss_to`` between the record nearest ``(1 - tail) * steps`` and the last record.
    """
    end = history[-1]
    target = (1 - tail) * end["step"]
    start = min(history, key=lambda r: abs(r["step"] - target))
    rel = (start["held_loss"] - end["held_loss"]) / end["held_loss"]
    return {
        "from_step": start["step"],
        "to_step": end["step"],
        "loss_from": start["held_loss"],
        "loss_to": end["held_loss"],
        "rel_change": rel,
    }


# ------------------------------------------------------------------------------------------- alignment
METHODS = (
    "plain",
    "weight_permutation",
    "activation_permutation",
    "full",
    "weight_full",
    "activation_permutation_first",
    "activation_permutation_last",
)
LABELS = {
    "plain": "plain averaging",
    "weight_permutation": "weight-based permutations (FFN + heads)",
    "activation_permutation": "activation-based permutations (FFN + heads + residual)",
    "full": "activation permutations + rotation + scaling",
    "weight_full": "weight-based permutations + rotation + scaling (extra)",
    "activation_permutation_first": "activation-based permutations, residual strategy `first` (extra)",
    "activation_permutation_last": "activation-based permutations, residual strategy `last` (extra)",
}


def align(method: str, source: torch.nn.Module, anchor: torch.nn.Module, batches: list) -> dict[str, torch.Tensor]:
    """SOURCE's state dict aligned to ANCHOR by ``method`` (one of :data:`METHODS`); same function as SOURCE."""
    from symfuse.arch import get_spec
    from symfuse.match.activation import match_activations
    from symfuse.match.weights import match_module_weights

    if method == "plain":
        return {k: v.clone() for k, v in source.state_dict().items()}
    if method.startswith("activation_permutation") or method == "full":
        syms = ("residual-permutation", "head-permutation", "ffn-permutation")
        syms += ("rotation", "scaling") if method == "full" else ()
        strategy = method.rsplit("_", 1)[1] if method.endswith(("_first", "_last")) else "all"
        return match_activations(source, anchor, batches, symmetries=syms, residual_strategy=strategy).state
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
Batches = list[dict[str, torch.Tensor]]


def _emotion(split: str, tok, voc: Vocab, cap: int | None) -> tuple[list[torch.Tensor], torch.Tensor, list[str]]:
    """dair_emotion ``split`` (first ``cap`` rows): per-example ``[CLS] ... [SEP]`` ids in ``voc`` ids, labels."""
    rows = [json.loads(line) for line in (DATASETS / "dair_emotion" / f"{split}.jsonl").read_text().splitlines()]
    labels = json.loads((DATASETS / "dair_emotion" / "meta.json").read_text())["labels"]
    rows = rows[:cap] if cap else rows
    enc = tok([r["text"] for r in rows], truncation=True, max_length=SEQ)["input_ids"]
    y = torch.tensor([labels.index(r["label"]) for r in rows])
    return [voc(torch.tensor(e)) for e in enc], y, labels


def _pad(seqs: list[torch.Tensor], pad: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sequence of this batch: ``input_ids`` and ``attention_mask`` (batch, length)."""
    ids = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=pad)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(x) for x in seqs], batch_first=True, padding_value=0)
    return {"input_ids": ids, "attention_mask": mask}


def _batches(seqs: list[torch.Tensor], pad: int, size: int = 128) -> Batches:
    return [_pad(seqs[i : i + size], pad) for i in range(0, len(seqs), size)]


def scores(model: torch.nn.Module, batches: Batches, y: torch.Tensor) -> dict[str, float]:
    """Accuracy and mean cross-entropy of a classifier on padded batches covering ``y`` in order."""
    model.eval()
    with torch.no_grad():
        logits = torch.cat([model(**b).logits for b in batches])
    return {
        "accuracy": float((logits.argmax(-1) == y).float().mean()),
        "loss": float(torch.nn.functional.cross_entropy(logits, y)),
    }


def finetune(
    pre: Path, out: Path, seed: int, tok, voc: Vocab, args: argparse.Namespace, val: tuple[Batches, torch.Tensor]
) -> tuple[T.BertForSequenceClassification, list[dict]]:
    """Fine-tune a pre-trained MLM folder on dair_emotion (first ``ft_examples``), or load it when ``out`` exists.

    Returns:
        The model (eval mode) and its per-epoch history (train loss, validation accuracy / loss).
    """
    if (out / "config.json").exists():
        return T.BertForSequenceClassification.from_pretrained(out).eval(), json.loads(
            (out / "ft_history.json").read_text()
        )
    seqs, y, labels = _emotion("train", tok, voc, args.ft_examples)
    torch.manual_seed(seed)
    model = T.BertForSequenceClassification.from_pretrained(
        pre,
        num_labels=len(labels),
        hidden_dropout_prob=args.ft_dropout,
        attention_probs_dropout_prob=args.ft_dropout,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=args.ft_lr, weight_decay=0.01)
    steps = args.ft_epochs * math.ceil(len(y) / args.ft_batch)
    warm = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, steps, warm))
    g = torch.Generator().manual_seed(seed)
    history, t0 = [], time.time()
    for epoch in range(args.ft_epochs):
        model.train()
        losses = []
        for idx in torch.randperm(len(y), generator=g).split(args.ft_batch):
            loss = model(**_pad([seqs[i] for i in idx], voc.pad), labels=y[idx]).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item())
        rec = {"epoch": epoch + 1, "train_loss": sum(losses) / len(losses), **scores(model, *val)}
        rec["seconds"] = round(time.time() - t0, 1)
        history.append(rec)
        log.info("fine-tune %s epoch %d: %s", out.name, epoch + 1, rec)
    model.eval()
    model.save_pretrained(out)
    (out / "ft_history.json").write_text(json.dumps(history, indent=1))
    return model, history


# ------------------------------------------------------------------------------------------- evaluate
def evaluate(args: argparse.Namespace) -> None:
    """Align B to A by every method, MLM loss along each path, fine-tuned midpoint accuracy; write results."""
    from symfuse.evaluate.barrier import barrier_from_losses, default_lambdas, interpolate_state, interpolation_losses

    torch.set_num_threads(args.threads)
    t0 = time.time()
    tok = tokenizer()
    run = json.loads((WORK / "pretrain_seed0" / "run.json").read_text())
    voc = vocab(tok, run["min_count"])
    a = T.BertForMaskedLM.from_pretrained(WORK / "pretrain_seed0").eval()
    b = T.BertForMaskedLM.from_pretrained(WORK / "pretrain_seed1").eval()
    train, held = blocks("train", tok, voc), blocks("validation", tok, voc)
    held_in, held_lab = mask_tokens(held[: args.eval_blocks], voc, torch.Generator().manual_seed(777))
    stat_batches = _stat_batches(train, args.stat_blocks)
    lambdas = default_lambdas(args.points)

    def held_loss(model: torch.nn.Module) -> float:
        return held_out_loss(model, held_in, held_lab)

    results: dict = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "pretrain_config": run,
        "model": MODEL,
        "vocab": {"size": voc.size, "minilm_size": tok.vocab_size, "min_count": run["min_count"]},
        "mlm": {},
    }
    for name in ("pretrain_seed0", "pretrain_seed1"):
        hist = json.loads((WORK / name / "history.json").read_text())
        results[name] = {
            "steps": hist[-1]["step"],
            "seconds": hist[-1]["seconds"],
            "stability": stability(hist),
            "history": hist,
        }
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
    for m in METHODS:
        results[f"barrier_{m}"] = results["mlm"][m]["barrier"]
    # fine-tuned: accuracy of the midpoint model
    if args.ft_examples > 0:
        vs, vy, _ = _emotion("validation", tok, voc, args.ft_eval)
        val = (_batches(vs, voc.pad), vy)
        fa, ha = finetune(WORK / "pretrain_seed0", WORK / "ft_seed0", 0, tok, voc, args, val)
        fb, hb = finetune(WORK / "pretrain_seed1", WORK / "ft_seed1", 1, tok, voc, args, val)
        ss = _emotion("train", tok, voc, args.stat_blocks * 2)[0]  # statistics inputs: emotion training texts
        ft_batches = _batches(ss, voc.pad, 32)
        ft = {
            "majority_accuracy": float((vy == vy.mode().values).float().mean()),
            "A": scores(fa, *val),
            "B": scores(fb, *val),
            "history_A": ha,
            "history_B": hb,
            "midpoint": {},
        }
        for m in METHODS:
            st = align(m, fb, fa, ft_batches)
            mid = copy.deepcopy(fa)
            mid.load_state_dict(interpolate_state(fa.state_dict(), st, 0.5))
            ft["midpoint"][m] = scores(mid, *val)
            log.info("fine-tuned midpoint %-24s %s", m, ft["midpoint"][m])
        results["finetuned"] = ft
    results["seconds"] = round(time.time() - t0, 1)
    write_results(results, lambdas, args.results)


def write_results(results: dict, lambdas: list[float], out: Path = RESULTS) -> None:
    """Write ``bench/results/different_init.{json,png}`` and the table part of the markdown; print the table."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "different_init.json").write_text(json.dumps(results, indent=1))
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.2))
    for m in METHODS:
        ax.plot(lambdas, results["mlm"][m]["losses"], "o-", ms=3, label=LABELS[m])
    ax.set_xlabel("λ  (0 = model A, 1 = aligned model B)")
    ax.set_ylabel("held-out MLM loss")
    ax.set_title("Two BERT-style MLMs from different seeds: interpolation path", fontsize=9)
    ax.legend(fontsize=7)
    for i, name in enumerate(("pretrain_seed0", "pretrain_seed1")):
        h = results[name]["history"]
        bx.plot([r["step"] for r in h], [r["held_loss"] for r in h], "-", label=f"seed {i} held-out")
        bx.plot([r["step"] for r in h], [r["train_loss"] for r in h], ":", label=f"seed {i} train (mean per 100 steps)")
        st = results[name]["stability"]
        bx.axvspan(st["from_step"], st["to_step"], color="grey", alpha=0.1)
    bx.set_xlabel("pre-training step (shaded: last 20 %, where stability is measured)")
    bx.set_ylabel("MLM loss")
    bx.set_ylim(top=8.0)
    bx.set_title("Pre-training curves", fontsize=9)
    bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "different_init.png", dpi=120)
    plt.close(fig)
    plain = results["barrier_plain"]
    lines = [
        "| method | MLM loss barrier | reduction vs plain | midpoint MLM loss | max abs Δlogits (aligned B vs B) "
        "| fine-tuned midpoint acc. | fine-tuned midpoint loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in METHODS:
        r = results["mlm"][m]
        mid = results.get("finetuned", {}).get("midpoint", {}).get(m)
        red = 1 - r["barrier"] / plain if plain else float("nan")
        lines.append(
            f"| {LABELS[m]} | {r['barrier']:.4f} | {100 * red:.1f} % | {r['losses'][len(r['losses']) // 2]:.4f} | "
            f"{r['max_abs_logit_diff_vs_B']:.1e} | "
            + (f"{mid['accuracy']:.4f} | {mid['loss']:.4f}" if mid is not None else "n/a | n/a")
            + " |"
        )
    table = "\n".join(lines)
    (out / "different_init_table.md").write_text(table + "\n")
    print(table)


def main() -> None:
    """Command-line entry point (see the module docstring)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="stage", required=True)
    pt = sub.add_parser("pretrain")
    pt.add_argument("--seed", type=int, required=True)
    pt.add_argument("--steps", type=int, default=3000, help="total optimiser steps (the schedule depends on it)")
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
