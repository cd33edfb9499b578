"""FFN assignment: scipy's dense solver against the certified sparse solve, on two independently initialised models.

    python bench/assignment_speed.py [--workdir DIR] [--rounds 5]            # the assignment alone
    python bench/assignment_speed.py --job command [--workdir DIR] [--rounds 3] [--cases roberta-independent]

The models are bench/match_speed.py's roberta-base-shaped fixture (12 x d768, FFN 3072, seeds 0 and 1;
``roberta-planted``: seed 0 against its disguise). Assignment alone: per layer, the cost of the FFN permutation
problem (:func:`symfuse.match.weights.ffn_similarity`, negated), solved in one process by each method in turn,
``rounds`` times; per method the median over rounds of the sum over the 12 layers, and a check that every
method reaches the same optimum. Methods: ``scipy`` (``scipy.optimize.linear_sum_assignment`` on a float64
copy, as :func:`symfuse.match.closed_form.assign_max` falls back to), ``certified-torch`` (the certified sparse
solve with the torch version of every kernel) and, where the compiled kernels are built (``symfuse.native.LIB``;
``symfuse.match.lapcore`` before it), ``certified-native``. Whole command: ``symfuse match B A --out O`` through
:func:`symfuse.cli.main`, one fresh process per method and round, methods alternating; ``scipy`` there turns the
certified solve off.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from match_speed import prepare, run_cli  # a sibling: bench scripts run from bench/


def _kernels():
    """The module holding the compiled kernels' handle ``LIB``: symfuse.native (symfuse.match.lapcore before it)."""
    try:
        from symfuse import native as mod
    except ImportError:
        from symfuse.match import lapcore as mod
    return mod


def methods() -> list[str]:
    """The methods this checkout has."""
    return ["scipy", "certified-torch"] + (["certified-native"] if _kernels().LIB is not None else [])


def _solve(method: str, cost):
    import torch
    from scipy.optimize import linear_sum_assignment

    from symfuse.match.assignment import certified_sparse_assignment

    if method == "scipy":
        rows, cols = linear_sum_assignment(cost.to(torch.float64).numpy())
        x = torch.empty_like(torch.from_numpy(cols))
        x[torch.from_numpy(rows)] = torch.from_numpy(cols)
        return x.long()
    mod = _kernels()
    lib = mod.LIB
    if method == "certified-torch":
        mod.LIB = None  # every kernel's torch version
    try:
        return certified_sparse_assignment(cost)
    finally:
        mod.LIB = lib


def kernel_table(work: Path, rounds: int, case: str) -> None:
    """Per method: median (range) over rounds of the seconds summed over the layers' assignments."""
    import torch

    from symfuse.checkpoint import CheckpointReader
    from symfuse.match.weights import ffn_similarity

    source, anchor = prepare(case, work)
    costs = []
    with CheckpointReader(source) as src, CheckpointReader(anchor) as anc:
        for ref in src.modules():
            if ref.kind == "ffn":
                costs.append(ffn_similarity(src.read_module(ref), anc.read_module(ref)).neg_())
    secs: dict[str, list[float]] = {m: [] for m in methods()}
    optimum: dict[str, list[float]] = {}
    for _ in range(rounds):
        for m, taken in secs.items():
            total, values = 0.0, []
            for cost in costs:
                t0 = time.perf_counter()
                x = _solve(m, cost)
                total += time.perf_counter() - t0
                assert x is not None, f"{m}: no certificate"
                values.append(float(cost.double()[torch.arange(cost.shape[0]), x].sum()))
            taken.append(total)
            optimum[m] = values
    ref_values = optimum["scipy"]
    for m, values in optimum.items():
        worst = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(values, ref_values, strict=True))
        assert worst < 1e-9, f"{m}: optimum differs from scipy's by {worst:.1e}"
    print(f"{case}: {len(costs)} FFN assignments of n = {costs[0].shape[0]}, {rounds} rounds (same optimum: yes)")
    print("| method | seconds, 12 layers: median (range) | vs scipy |")
    print("|---|---|---|")
    base = statistics.median(secs["scipy"])
    for m, xs in secs.items():
        med = statistics.median(xs)
        print(f"| {m} | {med:.3f} ({min(xs):.3f}-{max(xs):.3f}) | {med / base:.2f}x |")


def one_command(work: Path, case: str, method: str) -> dict:
    """``symfuse match`` in this (fresh) process with one assignment method; seconds after the imports."""
    import torch  # noqa: F401  (imports are not timed)
    import transformers  # noqa: F401

    import symfuse.cli.commands
    import symfuse.cli.match  # noqa: F401
    from symfuse.match import closed_form

    source, anchor = prepare(case, work)
    if method == "scipy":
        closed_form.certified_sparse_assignment = lambda *a, **k: None  # the dense fallback only
    if method in ("scipy", "certified-torch"):
        _kernels().LIB = None  # the torch kernels (the sketch's too)
    out = work / f"{case}-{method}-cmd"
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    run_cli(["match", str(source), str(anchor), "--out", str(out)])
    seconds = time.perf_counter() - t0
    shutil.rmtree(out, ignore_errors=True)
    return {"seconds": seconds}


def command_table(work: Path, rounds: int, cases: list[str]) -> None:
    """Per case and method: median (range) over rounds of the whole command, each in a fresh process."""
    print("| case | method | command s: median (range) | vs scipy |")
    print("|---|---|---|---|")
    for case in cases:
        prepare(case, work)
        secs: dict[str, list[float]] = {m: [] for m in methods()}
        for _ in range(rounds):
            for m, taken in secs.items():
                cmd = [sys.executable, __file__, "--one-command", case, m, "--workdir", str(work)]
                proc = subprocess.run(cmd, check=True, capture_output=True, text=True)
                line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
                taken.append(json.loads(line[len("RESULT ") :])["seconds"])
        base = statistics.median(secs["scipy"])
        for m, xs in secs.items():
            med = statistics.median(xs)
            print(f"| {case} | {m} | {med:.2f} ({min(xs):.2f}-{max(xs):.2f}) | {med / base:.2f}x |", flush=True)


def main() -> None:
    """Prepare the fixture and print the tables."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--job", choices=["kernel", "command"], default="kernel")
    ap.add_argument("--cases", default="roberta-independent")
    ap.add_argument("--one-command", nargs=2, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one_command:
        print("RESULT " + json.dumps(one_command(args.workdir, *args.one_command)))
        return
    work = args.workdir or Path(tempfile.mkdtemp(prefix="symfuse-assign-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        if args.job == "kernel":
            for case in args.cases.split(","):
                kernel_table(work, args.rounds, case)
        else:
            command_table(work, args.rounds, args.cases.split(","))
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
