"""Device parity: the same symfuse call on two devices, compared (used by bench/gpu_check.py and its CPU tests).

Each check builds tiny inputs once (on the CPU), runs the library call with ``device=a`` and ``device=b`` and returns
rows ``{"check", "what", "max_rel", "tol", "ok", ...}``: the largest relative difference between the two outputs
(per tensor, ``||x_a - x_b|| / ||x_a||``, the worst tensor) against the stated tolerance. On the CPU against itself
every difference must be 0 (the tests check the machinery that way); CUDA against the CPU differs by the order of
floating-point sums (float32: ~1e-6 relative; TF32 is not enabled by symfuse).
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
for p in (str(ROOT / "src"), str(ROOT)):
    if p not in sys.path:
        sys.path.insert(0, p)

from tests.tiny import save_tiny, tiny_config  # noqa: E402

TOL_F32 = 1e-5  # float32 maths, another summation order
TOL_F64 = 1e-9  # float64 closed forms (RegMean's solve, transforms)
TOL_TRAIN = 5e-2  # a fine-tune under bf16 autocast against float32 (trajectories drift; weights stay close)
MATCH_KINDS = ("rotation", "scaling", "ffn-permutation", "head-permutation")
FAMILIES = ("bert", "gpt2", "llama")  # post-LN, Conv1D, RoPE + GQA
MERGES = {  # strategy -> extra inputs
    "simple": {},
    "fisher": {"stats": True},
    "regmean": {"stats": True},
    "regmean++": {"data": True},
    "task-arithmetic": {"base": True},
    "ties": {"base": True},
    "dare": {"base": True},
    "slerp": {"models": 2},
    "nuslerp": {"models": 2, "base": True},
    "multislerp": {"base": True},
    "karcher": {},
    "model-stock": {"base": True},
    "nearswap": {"models": 2, "params": {"t": 0.01}},
    "arcee-fusion": {"models": 2},
    "passthrough": {"models": 1, "params": {"scale": 0.5}},
    "breadcrumbs": {"base": True, "params": {"density": 0.8}},
    "breadcrumbs-ties": {"base": True, "params": {"density": 0.8}},
    "della": {"base": True, "params": {"density": 0.5}},  # random masks: drawn on the CPU, the same on every device
    "della-linear": {"base": True, "params": {"density": 0.5}},
    "sce": {"base": True},
}


def tensors_of(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a save_pretrained folder (all shards), on the CPU."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], floor: float = 1e-6) -> tuple[float, str]:
    """The largest per-tensor relative difference of two state dicts (same keys required).

    Per tensor ``||x_a - x_b|| / max(||x_a||, floor * ||state_a||)``: a tensor that is zero up to rounding (the Fisher
    of an attention key bias, whose gradient vanishes identically: softmax ignores a shift shared by every key) is
    compared with the state's scale, not with its own rounding noise.
    """
    if a.keys() != b.keys():
        raise AssertionError(f"different tensors: {sorted(a.keys() ^ b.keys())[:5]}")
    state = sum(float(t.double().norm()) ** 2 for t in a.values()) ** 0.5
    worst, where = 0.0, ""
    for k in sorted(a):
        x, y = a[k].double(), b[k].double()  # integer tensors too: any difference shows
        rel = float((x - y).norm()) / max(float(x.norm()), floor * state, 1e-30)
        if rel > worst:
            worst, where = rel, k
    return worst, where


def _row(check: str, what: str, rel: float, tol: float | None, **extra) -> dict:
    """One parity row; ``tol`` None: measured and shown, not held to a bound."""
    ok = None if tol is None else rel <= tol
    return {"check": check, "what": what, "max_rel": rel, "tol": tol, "ok": ok, **extra}


def text_classifier(folder: Path, tokenizer: Path, seed: int, labels: Sequence[str], base: Path | None = None) -> Path:
    """A tiny BERT classifier over ``labels`` with a real tokenizer (``base``'s weights plus a seeded 1 % delta)."""
    import transformers as T

    tok = T.AutoTokenizer.from_pretrained(str(tokenizer))
    cfg = tiny_config("bert", vocab_size=tok.vocab_size, num_labels=len(labels))
    cfg.id2label = dict(enumerate(labels))
    cfg.label2id = {v: k for k, v in cfg.id2label.items()}
    torch.manual_seed(seed)
    model = T.BertForSequenceClassification(cfg)
    if base is not None:
        model.load_state_dict(T.BertForSequenceClassification.from_pretrained(str(base)).state_dict())
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * p.abs().mean() * torch.randn(p.shape, generator=g))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def match_parity(work: Path, a: str, b: str, families: Sequence[str] = FAMILIES) -> list[dict]:
    """``match_checkpoints`` of a model's disguise onto the model, each kind alone and all together, on a and b."""
    from symfuse.match import disguise_checkpoint, match_checkpoints

    rows = []
    for fam in families:
        anchor = save_tiny(work / f"{fam}-anchor", fam)
        src = work / f"{fam}-disguised"
        disguise_checkpoint(anchor, src, seed=3, kinds=MATCH_KINDS)
        for kinds in [*([k] for k in MATCH_KINDS), list(MATCH_KINDS)]:
            outs, reports = [], []
            for side, dev in enumerate((a, b)):
                out = work / f"{fam}-{'+'.join(kinds)}-{side}"
                reports.append(match_checkpoints(src, anchor, out, kinds, device=dev, verify="full"))
                outs.append(tensors_of(out))
            rel, where = max_rel(*outs)
            tol = TOL_F32 if set(kinds) & {"rotation", "scaling"} else 0.0
            rows.append(
                _row("match", f"{fam} {'+'.join(kinds)}", rel, tol, worst=where,
                     distance_after=[r["distance_after"] for r in reports],
                     logit_diff=[r["max_abs_logit_diff"] for r in reports])
            )  # fmt: skip
    return rows


def stats_parity(work: Path, a: str, b: str, model: Path, data: str) -> tuple[list[dict], dict[str, Path]]:
    """Gram and Fisher statistics of ``model`` on ``data`` on both devices; returns rows and device a's folders."""
    from symfuse.stats import collect_stats

    rows, folders = [], {}
    outs = {}
    for side, dev in enumerate((a, b)):
        folder = work / f"stats-{model.name}-{side}"
        collect_stats(model, data, ["gram", "fisher"], folder, max_examples=48, batch_size=16, device=dev)
        outs[dev] = {k: tensors_of_file(folder / f"{k}.safetensors") for k in ("gram", "fisher")}
        folders[dev] = folder
    for kind in ("gram", "fisher"):
        rel, where = max_rel(outs[a][kind], outs[b][kind])
        rows.append(_row("stats", f"{kind} of {model.name}", rel, 1e-4, worst=where))
    return rows, folders


def tensors_of_file(file: Path) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file."""
    from safetensors.torch import load_file

    return load_file(str(file))


def merge_parity(work: Path, a: str, b: str, tokenizer: Path, data: str = "meld") -> list[dict]:
    """Every registered strategy's merge of three tiny fine-tunes on both devices (statistics from device a)."""
    from symfuse.data import load_task_dataset
    from symfuse.merge import merge_checkpoints

    labels = load_task_dataset(data).labels
    base = text_classifier(work / "base", tokenizer, 0, labels)
    models = [text_classifier(work / f"ft{i}", tokenizer, 10 + i, labels, base) for i in range(3)]
    rows, stats = [], []
    for m in models:
        r, folders = stats_parity(work, a, b, m, data)
        rows += r
        stats.append(folders[a])
    for strategy, needs in MERGES.items():
        outs = []
        for side, dev in enumerate((a, b)):
            out = work / f"merge-{strategy}-{side}"
            kw = {"stats": stats} if needs.get("stats") else {}
            kw |= {"base": base} if needs.get("base") else {}
            kw |= {"data": [data] * 3, "max_examples": 32} if needs.get("data") else {}
            k = needs.get("models", 3)  # slerp, nearswap ...: two; passthrough: one
            kw |= {"stats": kw["stats"][:k]} if "stats" in kw else {}
            merge_checkpoints(strategy, models[:k], out, device=dev, **kw, **needs.get("params", {}))
            outs.append(tensors_of(out))
        rel, where = max_rel(*outs)
        tol = TOL_F32 if strategy != "regmean++" else 1e-4  # regmean++ runs forward passes between its solves
        rows.append(_row("merge", strategy, rel, tol, worst=where))
    return rows


def train_eval_parity(work: Path, a: str, b: str, tokenizer: Path, data: str = "meld") -> list[dict]:
    """A short fine-tune on both devices, then ``evaluate`` on both.

    On CUDA the fine-tune runs twice: as users run it (bf16 autocast, fused AdamW) and in float32 (``amp`` off).
    The bf16 run is held to the losses (its weights are a different computation's: the rows show how far they
    go); the float32 run is held to the weights and the logits. The attention key biases are left out of the
    weights' comparison: softmax ignores a shift shared by every key, so their gradient is 0 in exact arithmetic
    (exactly 0 on the CPU), and AdamW, dividing the GPU's rounding noise by its own square root, moves them by about
    lr a step; the logits show that this changes nothing.
    """
    from symfuse.data import load_task_dataset
    from symfuse.evaluate import evaluate_model
    from symfuse.train import FinetuneConfig, finetune

    labels = load_task_dataset(data).labels
    base = text_classifier(work / "train-base", tokenizer, 0, labels)
    cfg = FinetuneConfig(epochs=1, lr=1e-3, batch_size=16, max_train_examples=96, max_eval_examples=32, progress=False)
    runs = {"a": (a, cfg), "b": (b, cfg), "b float32": (b, cfg.model_copy(update={"amp": False}))}
    trained = {name: work / f"trained-{name.replace(' ', '-')}" for name in runs}
    for name, (dev, c) in runs.items():
        finetune(base, data, trained[name], c, device=dev)
    reports = {n: json.loads((f / "symfuse_train.json").read_text()) for n, f in trained.items()}
    last = {n: {k: r["epochs"][-1][k] for k in ("train_loss", "val_loss")} | {"device": r["device"]}
            for n, r in reports.items()}  # fmt: skip
    rows = []
    for name, tol_weights, tol_logits in (("b", None, None), ("b float32", TOL_TRAIN, 1e-3)):
        losses = max(abs(last[name][k] - last["a"][k]) / abs(last["a"][k]) for k in ("train_loss", "val_loss"))
        weights = [{k: v for k, v in tensors_of(trained[n]).items() if not k.endswith("key.bias")} for n in ("a", name)]
        rel, where = max_rel(*weights)
        what = f"1 epoch of 96 {data} examples, {'bf16 autocast' if name == 'b' else 'float32'} on b"
        rows += [
            _row("finetune", f"{what}: losses", losses, 1e-3, last=[last["a"], last[name]]),
            _row("finetune", f"{what}: weights but the key biases", rel, tol_weights, worst=where),
            _row(
                "finetune", f"{what}: logits, 32 random sequences", logit_rel(trained["a"], trained[name]), tol_logits
            ),
        ]
    scores = [evaluate_model(trained["a"], data, split="test", max_examples=128, device=dev) for dev in (a, b)]
    keys = [k for k, v in scores[0].items() if isinstance(v, float) and k != "seconds"]
    diff = max((abs(scores[0][k] - scores[1][k]) for k in keys), default=0.0)
    rows.append(_row("evaluate", f"{data} test, 128 examples ({', '.join(keys)})", diff, 1e-3))
    return rows


def logit_rel(a: Path, b: Path, n: int = 32, length: int = 24) -> float:
    """``||logits_a - logits_b|| / ||logits_a||`` of two classifiers on the same random token sequences (CPU)."""
    import transformers as T

    models = [T.AutoModelForSequenceClassification.from_pretrained(str(f)).eval() for f in (a, b)]
    ids = torch.randint(0, models[0].config.vocab_size, (n, length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        la, lb = (m(input_ids=ids).logits.double() for m in models)
    return float((la - lb).norm() / la.norm())


def lora_parity(work: Path, a: str, b: str) -> list[dict]:
    """``merge_adapters`` of two PEFT adapters (and a DoRA pair into the base) on both devices, each basis."""
    from symfuse.lora import merge_adapters
    from tests.symfuse.lora.helpers import make_adapter, tiny_base

    base = tiny_base(work / "lora-base")
    plain = [make_adapter(base, work / f"lora-{i}", seed=i, r=4 + 2 * i) for i in range(2)]
    dora = [make_adapter(base, work / f"dora-{i}", seed=10 + i, use_dora=True) for i in range(2)]
    cases = [(f"ties, {basis} basis", plain, {"basis": basis}) for basis in ("aligned", "full")]
    cases.append(("ties, naive basis (one rank)", [make_adapter(base, work / f"lora-n{i}", seed=20 + i)
                                                   for i in range(2)], {"basis": "naive"}))  # fmt: skip
    cases.append(("DoRA, ties, into the base", dora, {"base": base, "into_base": True}))
    rows = []
    for what, adapters, kw in cases:
        outs = []
        for side, dev in enumerate((a, b)):
            out = work / f"lora-{what.replace(' ', '-').replace(',', '')}-{side}"
            merge_adapters(adapters, out, "ties", device=dev, density=0.5, **kw)
            outs.append(tensors_of(out))
        rel, where = max_rel(*outs)
        rows.append(_row("merge-lora", what, rel, TOL_F32, worst=where))
    return rows


def all_parity(work: Path, a: str, b: str, tokenizer: Path) -> list[dict]:
    """Every parity check; a check that raises becomes a failed row with its error (the others still run)."""
    rows: list[dict] = []
    for name, fn in (
        ("match", lambda w: match_parity(w, a, b)),
        ("merge+stats", lambda w: merge_parity(w, a, b, tokenizer)),
        ("finetune+evaluate", lambda w: train_eval_parity(w, a, b, tokenizer)),
        ("merge-lora", lambda w: lora_parity(w, a, b)),
    ):
        w = work / name
        shutil.rmtree(w, ignore_errors=True)
        w.mkdir(parents=True)
        try:
            rows += fn(w)
        except Exception as exc:  # reported, not hidden: the row says what failed
            import traceback

            rows.append({"check": name, "what": "raised", "ok": False, "error": repr(exc)[:500],
                         "trace": traceback.format_exc()[-2000:]})  # fmt: skip
    return rows
