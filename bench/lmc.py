"""Linear mode connectivity of GPT-2 models trained from different seeds, before and after each alignment.

The models come from ``bench/lmc_train.py`` (6 layers, d 256, 4 heads, MLP 1024 on Tiny Shakespeare; trained on one
H100 by bench/gpu_session.sh, saved in float16 and read back in float32). For a pair (A, B) and an alignment that
maps B onto A exactly (same function), the test loss is measured along ``theta(l) = (1 - l) theta_A + l theta_B'``
at ``--points`` values of l; the barrier is ``max_l [L(l) - ((1 - l) L(0) + l L(1))]`` (nats). Rows:

* ``plain``: no alignment (the stored parameters); ``plain, norms folded``: both models with their norms folded into
  the layers that read them (same functions, another parametrisation: the path changes);
* today's kinds, from weights: FFN + head permutations; + per-head rotation and scaling;
* today's kinds from activations (train windows): residual, FFN and head permutations (+ rotation and scaling);
* ``residual-orthogonal``: one orthogonal map of the stream (the subgroup fixing the ones vector: GPT-2 is
  pre-LayerNorm) alternated with FFN / head permutations and rotations + scalings (in one row ``head-linear``'s
  invertible head maps), from the identity (weights only) or from the Procrustes solution on paired hidden states
  (activations);
* K = 3: seeds 1 and 2 aligned onto seed 0, the three averaged: loss of the average minus the endpoints' mean.
* ``width: ...`` (only with ``--only width``): seed A (d 256) widened exactly into the shapes of ``--wide`` (d 512,
  8 heads, MLP 2048; :mod:`symfuse.symmetry.widen`) and aligned onto it by residual-orthogonal (from the weights, or
  from paired hidden states); the path runs from the wide model to the aligned one, in the WIDE model's config (its
  norm epsilon: ``max_dlogit_wide_eps``); ``max_dlogit`` is measured in the widened config (epsilon scaled by
  d_n / d_w), where the embedding is exact.

Each alignment's ``max |dlogit|``: the aligned B against B on test windows (float32; B is stored in float16).

Usage: python bench/lmc.py [--runs .lmc_runs] [--pair 0 1] [--points 21] [--out bench/results]
       python bench/lmc.py --only width [--wide wide3] (seed --pair[0] into the wide model)
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path[:0] = [str(BENCH), str(ROOT / "src")]

import lmc_train  # noqa: E402

from symfuse.arch import get_spec  # noqa: E402
from symfuse.match.activation import match_activations  # noqa: E402
from symfuse.match.refine import refine_stream_map  # noqa: E402
from symfuse.match.residual_orthogonal import activation_init, align_residual_orthogonal  # noqa: E402
from symfuse.match.weights import match_module_weights  # noqa: E402
from symfuse.symmetry.residual_orthogonal import fold_norms, rotate_residual  # noqa: E402
from symfuse.symmetry.widen import untie, widen_state, widening_map  # noqa: E402

PERMS = ("ffn-permutation", "head-permutation")
ROT = (*PERMS, "rotation", "scaling")
HEAD_LINEAR = (*PERMS, "head-linear")  # invertible per-head maps in place of rotation / scaling
State = dict[str, torch.Tensor]


def load(folder: Path) -> torch.nn.Module:
    """A trained model in float32, eval mode."""
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(str(folder), dtype=torch.float32).eval()


def state_of(model: torch.nn.Module) -> State:
    """Parameters by name (no buffers), detached float32 copies."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def with_state(model: torch.nn.Module, state: State, untied: bool) -> torch.nn.Module:
    """A copy of ``model``'s architecture holding ``state`` (untied LM head when asked)."""
    cfg = copy.deepcopy(model.config)
    if untied:
        cfg.tie_word_embeddings = False
    new = type(model)(cfg).eval()
    full = new.state_dict()
    for n, t in state.items():
        full[n] = t.to(full[n].dtype)
    if not untied and "lm_head.weight" in full:
        full["lm_head.weight"] = full["transformer.wte.weight"]
    new.load_state_dict(full)
    return new


def path_losses(model, a: State, b: State, untied: bool, stream: torch.Tensor, points: int) -> list[float]:
    """Test loss at ``points`` evenly spaced l in [0, 1] along ``(1 - l) a + l b``."""
    out = []
    for i in range(points):
        lam = i / (points - 1)
        mix = {n: (1 - lam) * a[n].double() + lam * b[n].double() for n in a}
        out.append(lmc_train.eval_loss(with_state(model, mix, untied), stream, torch.device("cpu")))
    return out


def barrier(losses: list[float]) -> float:
    """``max_l L(l) - linear interpolation of the end points`` (nats)."""
    n = len(losses) - 1
    return max(loss - ((1 - i / n) * losses[0] + i / n * losses[-1]) for i, loss in enumerate(losses))


def logit_diff(model, state: State, untied: bool, reference: torch.nn.Module, stream: torch.Tensor) -> float:
    """Largest |logit difference| of ``state`` against ``reference`` on the first 4 windows of ``stream``."""
    x = stream[: 4 * 256].view(4, 256)
    with torch.no_grad():
        got = with_state(model, state, untied)(input_ids=x).logits
        want = reference(input_ids=x).logits
    return float((got - want).abs().max())


def per_module(src: State, anc: State, model, kinds) -> State:
    """Today's ``symfuse match`` from weights: every module matched on its own (no residual map)."""
    spec, cfg = get_spec(model.config), model.config
    prefix = spec.detect_prefix(src)
    out, geo = dict(src), spec.geometry(cfg)
    for ref in spec.modules(cfg):
        ws = spec.read_module(src.__getitem__, src.__contains__, ref, cfg, prefix)
        wa = spec.read_module(anc.__getitem__, anc.__contains__, ref, cfg, prefix)
        out.update(spec.write_module(match_module_weights(ref, ws, wa, geo, kinds).apply(ws), ref, cfg, prefix))
    return out


def train_batches(stream: torch.Tensor, n: int = 32) -> list[dict[str, torch.Tensor]]:
    """``n`` consecutive 256-token windows of the train stream, in batches of 8 (matching statistics)."""
    x = stream[: n * 256].view(n, 256)
    return [{"input_ids": x[i : i + 8], "attention_mask": torch.ones_like(x[i : i + 8])} for i in range(0, n, 8)]


def hidden(model, state: State, untied: bool, batches) -> list[torch.Tensor]:
    """Residual-stream states (embedding output and every block's output; not the final norm's) on ``batches``."""
    m = with_state(model, state, untied)
    per_layer: list[list[torch.Tensor]] = []
    with torch.no_grad():
        for b in batches:
            hs = m.transformer(input_ids=b["input_ids"], output_hidden_states=True).hidden_states[:-1]
            per_layer.append(list(hs))
    return [torch.cat([p[i] for p in per_layer]) for i in range(len(per_layer[0]))]


def alignments(a_model, b_model, batches, refine_batches=(), steps: int = 200) -> dict[str, Callable[[], tuple]]:
    """Each row's ``(A's state, B's aligned state, untied)``, computed on demand."""
    spec, cfg = get_spec(a_model.config), a_model.config
    sa, sb = state_of(a_model), state_of(b_model)

    def folded():
        fa, ua = fold_norms(sa, spec, cfg)
        fb, ub = fold_norms(sb, spec, cfg)
        return fa, fb, ua or ub

    def acts(kinds):
        return lambda: (sa, match_activations(b_model, a_model, batches, kinds).state, False)

    def ortho(init: str, kinds=ROT, refine: bool = False):
        def run():
            start = None
            if init == "activations":
                fa, fb, untied = folded()
                start = activation_init(hidden(b_model, fb, untied, batches), hidden(a_model, fa, untied, batches),
                                        spec.residual_group)  # fmt: skip
            r = align_residual_orthogonal(sb, sa, spec, cfg, kinds=kinds, iters=30, init=start)
            if not refine:
                return r.anchor, r.aligned, r.untied
            template = with_state(a_model, r.anchor, r.untied)
            rot, losses = refine_stream_map(r.aligned, r.anchor, template, spec, spec.residual_group, refine_batches,
                                            steps=steps)  # fmt: skip
            print(f"  refinement loss {losses[0]:.4f} -> {sum(losses[-20:]) / 20:.4f} (last 20)", flush=True)
            return r.anchor, rotate_residual(r.aligned, spec, cfg, rot), r.untied

        return run

    return {
        "plain": lambda: (sa, sb, False),
        "plain, norms folded": folded,
        "weights: FFN + head permutations": lambda: (sa, per_module(sb, sa, a_model, PERMS), False),
        "weights: + rotation + scaling (today)": lambda: (sa, per_module(sb, sa, a_model, ROT), False),
        "activations: residual + FFN + head permutations": acts(("residual-permutation", *PERMS)),
        "activations: + rotation + scaling (today)": acts(("residual-permutation", *ROT)),
        "residual-orthogonal + permutations + rotation/scaling, weights": ortho("identity"),
        "residual-orthogonal + permutations + rotation/scaling, activations init": ortho("activations"),
        "residual-orthogonal + permutations + head-linear, activations init": ortho("activations", HEAD_LINEAR),
        "residual-orthogonal + permutations + rotation/scaling, activations init, learned refinement": ortho(
            "activations", refine=True
        ),
    }


def width_alignments(wide, narrow, batches) -> tuple[dict[str, Callable[[], tuple]], torch.nn.Module]:
    """The width rows' ``(wide state, narrow widened and aligned, untied)`` and the widened config's template."""
    spec = get_spec(wide.config)
    sw = untie(state_of(wide), spec, wide.config)  # the widened head is its own tensor: the anchor's too
    sn, cfg = widen_state(state_of(narrow), spec, narrow.config, wide.config)
    exact = with_state(wide, {}, True)
    exact.config = cfg  # with_state copies this config: the widened one (epsilon scaled)
    align_cfg = copy.deepcopy(cfg)
    align_cfg.tie_word_embeddings = False

    def ortho(init: str):
        def run():
            start = None
            if init == "activations":  # the widened stream is the narrow one times V
                v = widening_map(narrow.config.n_embd, wide.config.n_embd, spec.residual_group)
                hn = [h.double() @ v for h in hidden(narrow, state_of(narrow), False, batches)]
                start = activation_init(hn, hidden(wide, state_of(wide), False, batches), spec.residual_group)
            r = align_residual_orthogonal(sn, sw, spec, align_cfg, kinds=ROT, iters=30, init=start)
            return r.anchor, r.aligned, True

        return run

    return {
        "width: plain (seed widened, not aligned)": lambda: (sw, sn, True),
        "width: residual-orthogonal + permutations + rotation/scaling, weights": ortho("identity"),
        "width: residual-orthogonal + permutations + rotation/scaling, activations init": ortho("activations"),
    }, exact


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=Path, default=ROOT / ".lmc_runs")
    ap.add_argument("--pair", type=int, nargs=2, default=[0, 1])
    ap.add_argument("--third", type=int, default=2, help="the K = 3 case's third seed (-1: skip)")
    ap.add_argument("--points", type=int, default=21)
    ap.add_argument("--out", type=Path, default=BENCH / "results")
    ap.add_argument("--only", default=None, help="run only the rows whose name contains this (merged into lmc.json)")
    ap.add_argument("--steps", type=int, default=200, help="learned refinement: optimiser steps")
    ap.add_argument("--wide", default="wide3", help="width rows: the wide model's folder under --runs")
    args = ap.parse_args()
    torch.manual_seed(0)
    tok = lmc_train.Tokenizer.from_file(str(lmc_train.TOKENIZER))
    test = lmc_train.token_stream(tok, lmc_train.DATA, "test")
    train = lmc_train.token_stream(tok, lmc_train.DATA, "train")
    batches = train_batches(train)
    refine_batches = train_batches(train[32 * 256 :], 256)  # other train windows than the matching statistics
    if args.only is not None and "width" in args.only:  # A: the wide model; B: seed --pair[0], widened into it
        a, b = load(args.runs / args.wide), load(args.runs / f"seed{args.pair[0]}")
        makers, exact = width_alignments(a, b, batches)
    else:
        a, b = (load(args.runs / f"seed{s}") for s in args.pair)
        makers, exact = alignments(a, b, batches, refine_batches, args.steps), a
    rows, t0 = [], time.perf_counter()
    for name, make in makers.items():
        if args.only is not None and args.only not in name:
            continue
        t1 = time.perf_counter()
        sa, sb, untied = make()
        seconds = time.perf_counter() - t1
        losses = path_losses(a, sa, sb, untied, test, args.points)
        rows.append({"row": name, "barrier": barrier(losses), "mid": losses[len(losses) // 2], "L0": losses[0],
                     "L1": losses[-1], "max_dlogit": logit_diff(exact, sb, untied, b, test), "align_s": seconds,
                     "losses": losses})  # fmt: skip
        if exact is not a:  # the path's config: the wide model's epsilon
            rows[-1]["max_dlogit_wide_eps"] = logit_diff(a, sb, untied, b, test)
        print(f"{name:70s} barrier {rows[-1]['barrier']:.4f}  mid {rows[-1]['mid']:.4f}  "
              f"dlogit {rows[-1]['max_dlogit']:.1e}  ({seconds:.1f} s)", flush=True)  # fmt: skip
    k3 = three_way(args, a, test, batches) if args.third >= 0 and args.only is None else None
    write(args, rows, k3, time.perf_counter() - t0)


def three_way(args, a, test, batches) -> dict:
    """Seeds B and C aligned onto A (residual-orthogonal, activations init), the three averaged."""
    sa = state_of(a)
    out = {}
    for label, align in (("plain", False), ("residual-orthogonal", True)):
        states, ends = [], []
        for s in (args.pair[1], args.third):
            m = load(args.runs / f"seed{s}")
            if align:
                rows = alignments(a, m, batches)
                fa, sm, untied = rows["residual-orthogonal + permutations + rotation/scaling, activations init"]()
            else:
                fa, sm, untied = sa, state_of(m), False
            states.append(sm)
            ends.append(lmc_train.eval_loss(with_state(a, sm, untied), test, torch.device("cpu")))
        l_a = lmc_train.eval_loss(with_state(a, fa, untied), test, torch.device("cpu"))
        mean = {n: (fa[n].double() + states[0][n].double() + states[1][n].double()) / 3 for n in fa}
        loss = lmc_train.eval_loss(with_state(a, mean, untied), test, torch.device("cpu"))
        out[label] = {"loss_of_average": loss, "endpoints": [l_a, *ends], "barrier": loss - (l_a + sum(ends)) / 3}
        print(f"K=3 {label}: loss of the average {loss:.4f}, barrier {out[label]['barrier']:.4f}", flush=True)
    return out


def write(args, rows: list[dict], k3: dict | None, seconds: float) -> None:
    """bench/results/lmc.json and lmc_table.md (rows of an earlier run kept unless measured again)."""
    old = args.out / "lmc.json"
    if args.only is not None and old.exists():
        before = json.loads(old.read_text())
        new_names = {r["row"] for r in rows}
        rows = [r for r in before["rows"] if r["row"] not in new_names] + rows
        k3 = k3 or before.get("k3")
    today = [r["barrier"] for r in rows if r["row"].startswith(("weights", "activations"))]
    new = [r["barrier"] for r in rows if r["row"].startswith("residual-orthogonal") and "learned" not in r["row"]]
    summary = {
        "barrier_plain": next((r["barrier"] for r in rows if r["row"] == "plain"), None),
        "barrier_permutation_rotation": min(today, default=None),
        "barrier_residual_orthogonal": min(new, default=None),
        "barrier_learned": min((r["barrier"] for r in rows if "learned" in r["row"]), default=None),
        "pair": args.pair,
        "points": args.points,
        "command": " ".join(["python", *sys.argv]),
        "seconds": seconds,
    }
    (args.out / "lmc.json").write_text(json.dumps({**summary, "rows": rows, "k3": k3}, indent=1))
    lines = [f"| {r['row']} | {r['barrier']:.4f} | {r['mid']:.4f} | {r['L0']:.4f} | {r['L1']:.4f} | "
             f"{r['max_dlogit']:.1e} | {r['align_s']:.1f} |" for r in rows]  # fmt: skip
    table = "\n".join(["| alignment | barrier (nats) | midpoint loss | L(A) | L(B') | max abs dlogit | align s |",
                       "|---|---|---|---|---|---|---|", *lines])  # fmt: skip
    (args.out / "lmc_table.md").write_text(table + "\n")
    print(table)
    print(json.dumps(summary, indent=1))
    if k3:
        print(json.dumps(k3, indent=1))


if __name__ == "__main__":
    main()
