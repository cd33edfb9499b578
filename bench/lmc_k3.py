"""K = 3 models from different seeds, averaged: aligned onto one anchor, or onto their common mean (universe matching).

The models are bench/lmc.py's (seeds 0, 1, 2 of bench/lmc_train.py). Both rows use ``residual-orthogonal`` from the
weights with FFN + head permutations and (``--kinds rot``, the default) rotation / scaling
(:func:`symfuse.match.universe.align_universe`); the barycenter row aligns all three onto the mean of the aligned
set, ``--rounds`` times. The K = 3 barrier is the test loss of the three-way
average minus the mean of the three end points' losses (nats). The rows are merged into bench/results/lmc.json's
``k3`` mapping (next to bench/lmc.py's row started from activations).

Usage: python bench/lmc_k3.py [--runs .lmc_runs] [--seeds 0 1 2] [--rounds 2] [--kinds rot|perms] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH), str(BENCH.parent / "src")]

import lmc  # noqa: E402
import lmc_train  # noqa: E402

from symfuse.arch import get_spec  # noqa: E402
from symfuse.match.universe import align_universe, folded_mean  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=Path, default=lmc.ROOT / ".lmc_runs")
    ap.add_argument("--seeds", type=int, nargs=3, default=[0, 1, 2])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--iters", type=int, default=10, help="rounds of each pairwise alignment at most")
    ap.add_argument(
        "--kinds", default="rot", choices=["perms", "rot"], help="per-module kinds: permutations (+ rotation / scaling)"
    )
    ap.add_argument("--out", type=Path, default=BENCH / "results")
    args = ap.parse_args()
    tok = lmc_train.Tokenizer.from_file(str(lmc_train.TOKENIZER))
    test = lmc_train.token_stream(tok, lmc_train.DATA, "test")
    models = [lmc.load(args.runs / f"seed{s}") for s in args.seeds]
    states = [lmc.state_of(m) for m in models]
    spec, cfg = get_spec(models[0].config), models[0].config
    cpu = torch.device("cpu")
    ends = [lmc_train.eval_loss(m, test, cpu) for m in models]
    rows = {}
    what = "permutations" if args.kinds == "perms" else "permutations + rotation / scaling"
    for label, anchor in ((f"residual-orthogonal + {what}, weights, onto seed 0", 0),
                          (f"residual-orthogonal + {what}, weights, universe", None)):  # fmt: skip
        t0 = time.perf_counter()
        kinds = lmc.ROT if args.kinds == "rot" else lmc.PERMS
        r = align_universe(states, spec, cfg, kinds, anchor=anchor, rounds=args.rounds, iters=args.iters)
        seconds = time.perf_counter() - t0
        loss = lmc_train.eval_loss(lmc.with_state(models[0], folded_mean(r.states), r.untied), test, cpu)
        rows[label] = {"loss_of_average": loss, "endpoints": ends, "barrier": loss - sum(ends) / 3,
                       "align_s": seconds, "rounds": r.history}  # fmt: skip
        print(f"K=3 {label}: loss of the average {loss:.4f}, barrier {rows[label]['barrier']:.4f} ({seconds:.0f} s)",
              flush=True)  # fmt: skip
    file = args.out / "lmc.json"
    old = json.loads(file.read_text()) if file.exists() else {}
    old["k3"] = {**(old.get("k3") or {}), **rows}
    old["k3_command"] = " ".join(["python", *sys.argv])
    file.write_text(json.dumps(old, indent=1))


if __name__ == "__main__":
    main()
