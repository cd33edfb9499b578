"""Evaluation stage of the different-initialisation experiment (``different_init.py evaluate``).

Aligns model B to model A by each method, measures the held-out MLM loss along the linear path, fine-tunes both on
one emotion dataset and reports the midpoint accuracy; writes ``bench/results/different_init.{md,json,png}``.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import time
from pathlib import Path

import torch
import transformers as T
from different_init_corpus import (  # a sibling: bench scripts run from bench/
    DATASETS,
    MODEL,
    RESULTS,
    SEQ,
    WORK,
    Vocab,
    blocks,
    held_out_loss,
    lr_factor,
    mask_tokens,
    optimizer_step,
    tokenizer,
    vocab,
)

log = logging.getLogger("different_init")


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
    "weight_head_linear",
    "activation_head_linear",
    "ot_weights",
    "ot_weights_full",
    "ot_acts",
    "ot_weights_soft",
    "ot_acts_soft",
)
OT_METHODS = {  # issue 16: OT fusion (symfuse.match.ot): (mode, soft, extra symmetries)
    "ot_weights": ("weights", False, ()),
    "ot_weights_full": ("weights", False, ("rotation", "scaling")),
    "ot_acts": ("acts", False, ()),
    "ot_weights_soft": ("weights", True, ()),
    "ot_acts_soft": ("acts", True, ()),
}
# issue 32: head-linear (an invertible d_head x d_head map per head on the QK and on the OV circuit, in place of
# rotation + scaling; exact on post-LN BERT, unlike residual-orthogonal): method -> kinds on top of the permutations
HEAD_LINEAR = {"weight_head_linear": ("head-linear",), "activation_head_linear": ("head-linear",)}
OT_REG = {"reg": 0.05}  # entropic regularisation of the soft rows (cost rescaled to [0, 1]); set by --ot-reg
LABELS = {
    "plain": "plain averaging",
    "weight_permutation": "weight-based permutations (FFN + heads)",
    "activation_permutation": "activation-based permutations (FFN + heads + residual)",
    "full": "activation permutations + rotation + scaling",
    "weight_full": "weight-based permutations + rotation + scaling (extra)",
    "activation_permutation_first": "activation-based permutations, residual strategy `first` (extra)",
    "activation_permutation_last": "activation-based permutations, residual strategy `last` (extra)",
    "weight_head_linear": "weight-based permutations (FFN + heads paired on QK / OV circuits) + head-linear",
    "activation_head_linear": "activation-based permutations (FFN + heads + residual) + head-linear",
    "ot_weights": "OT fusion, weights (EMD: residual by embedding columns, heads, FFN)",
    "ot_weights_full": "OT fusion, weights (EMD) + rotation + scaling",
    "ot_acts": "OT fusion, acts-EMD (residual, heads, FFN)",
    "ot_weights_soft": "OT fusion, weights, soft (Sinkhorn) — not exact",
    "ot_acts_soft": "OT fusion, acts, soft (Sinkhorn) — not exact",
}


def align(method: str, source: torch.nn.Module, anchor: torch.nn.Module, batches: list) -> dict[str, torch.Tensor]:
    """SOURCE's state dict aligned to ANCHOR by ``method`` (one of :data:`METHODS`).

    Same function as SOURCE for every method except the soft OT rows (``*_soft``), which average units.
    """
    from symfuse.arch import get_spec
    from symfuse.match.activation import match_activations
    from symfuse.match.weights import match_module_weights

    if method == "plain":
        return {k: v.clone() for k, v in source.state_dict().items()}
    if method in OT_METHODS:
        from symfuse.match.ot import ot_align

        mode, soft, extra = OT_METHODS[method]
        reg = OT_REG["reg"] if soft else 0.0
        return ot_align(source, anchor, mode, reg, batches, symmetries=extra).state
    if method.startswith("activation_") or method == "full":
        syms = ("residual-permutation", "head-permutation", "ffn-permutation")
        syms += ("rotation", "scaling") if method == "full" else HEAD_LINEAR.get(method, ())
        strategy = method.rsplit("_", 1)[1] if method.endswith(("_first", "_last")) else "all"
        return match_activations(source, anchor, batches, symmetries=syms, residual_strategy=strategy).state
    syms = ("ffn-permutation", "head-permutation") + (("rotation", "scaling") if method == "weight_full" else ())
    syms += HEAD_LINEAR.get(method, ())  # with head-permutation: heads paired on their circuits, then the maps
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
            optimizer_step(model, opt, sched, loss)
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
    OT_REG["reg"] = args.ot_reg
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
        "| loss of aligned B (λ = 1) | fine-tuned midpoint acc. | fine-tuned midpoint loss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m in METHODS:
        r = results["mlm"][m]
        mid = results.get("finetuned", {}).get("midpoint", {}).get(m)
        red = 1 - r["barrier"] / plain if plain else float("nan")
        lines.append(
            f"| {LABELS[m]} | {r['barrier']:.4f} | {100 * red:.1f} % | {r['losses'][len(r['losses']) // 2]:.4f} | "
            f"{r['max_abs_logit_diff_vs_B']:.1e} | {r['losses'][-1]:.4f} | "
            + (f"{mid['accuracy']:.4f} | {mid['loss']:.4f}" if mid is not None else "n/a | n/a")
            + " |"
        )
    table = "\n".join(lines)
    (out / "different_init_table.md").write_text(table + "\n")
    print(table)
