"""Where symmetry matters: two models trained from different seeds, aligned with each symmetry class, then merged.

    scripts/demo.sh --different-init          (= .venv/bin/python examples/different_init.py)
    .venv/bin/python examples/different_init.py [--out DIR] [--data crowdflower] [--steps 300] [--points 11]

Trains the two small GPT-2 models of ``examples/two_seeds.py`` once (cached in ``DIR/seeds``, a few minutes on a
CPU), aligns the second onto the first with each class of symmetries in turn (each alignment exact: the aligned model
computes the second model's function), measures the loss along the straight path from the first model to each
aligned second model, merges the best pair (``simple``: the average) and prints the barrier table. Writes
``DIR/different_init.md`` (the table), ``DIR/different_init.png`` (the loss paths) and ``DIR/merged``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from symfuse.cli.boundary import run_script
from symfuse.errors import UsageError
from symfuse.inspect.paths import path_figures
from symfuse.match.align import align_checkpoints
from symfuse.merge import merge_checkpoints

log = logging.getLogger("different_init")
PERMS = ["ffn-permutation", "head-permutation"]
ROWS = {  # name -> (kinds, found from activations)
    "weights: FFN + head permutations": (PERMS, False),
    "weights: + per-head rotation + scaling": ([*PERMS, "rotation", "scaling"], False),
    "activations: residual + FFN + head permutations": (["residual-permutation", *PERMS], True),
    "weights: residual-orthogonal + permutations + rotation / scaling": (
        ["residual-orthogonal", *PERMS, "rotation", "scaling"],
        False,
    ),
    "weights: residual-orthogonal + permutations + head-linear": (
        ["residual-orthogonal", *PERMS, "head-linear"],
        False,
    ),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The script's options (the model options are passed on to ``examples/two_seeds.py``)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    store = Path(os.environ.get("SYMFUSE_STORE", "symfuse-runs"))
    p.add_argument("--out", type=Path, default=store / "different-init", help="working folder (models cached there)")
    p.add_argument("--data", default="crowdflower", help="dataset whose texts train and score the models")
    p.add_argument("--points", type=int, default=11, help="points on each straight path (0 and 1 included)")
    p.add_argument("--max-examples", type=int, default=64, help="test texts scored at each point")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    return p.parse_known_args(argv)


def two_seeds() -> Any:
    """The module examples/two_seeds.py (which trains the pair)."""
    spec = importlib.util.spec_from_file_location("two_seeds", Path(__file__).with_name("two_seeds.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def seeds(args: argparse.Namespace, train_args: list[str]) -> Path:
    """``DIR/seeds`` with ``a`` and ``b`` trained by examples/two_seeds.py, reused when trained with these options."""
    folder, settings = args.out / "seeds", {"data": args.data, "train": train_args}
    marker = folder / "settings.json"
    if marker.is_file() and json.loads(marker.read_text()) == settings:
        log.info("reusing the two models in %s", folder)
        return folder
    if marker.is_file():
        shutil.rmtree(folder)  # this script's own cache, trained with other options
    elif folder.exists():
        raise SystemExit(f"error: {folder}: exists and was not written by this script — choose another --out")
    two_seeds().main(["--out", str(folder), "--data", args.data, "--device", args.device, *train_args])
    marker.write_text(json.dumps(settings))
    return folder


def align(a: Path, b: Path, out: Path, kinds: list[str], from_data: bool, args: argparse.Namespace) -> dict:
    """B aligned onto A with ``kinds`` into ``out``; the matcher's report (``max_abs_logit_diff``: exactness)."""
    data = args.data if from_data else None
    return align_checkpoints(b, a, out, kinds, data, max_examples=32, device=args.device, overwrite=True)


def plot(paths: dict[str, dict], lambdas: list[float], file: Path) -> Path:
    """The loss along each straight path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, p in paths.items():
        ax.plot(lambdas, p["losses"], "o-", ms=3, label=name)
    ax.set_xlabel("λ: (1 - λ) A + λ B'")
    ax.set_ylabel("test loss (nats)")
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(file, dpi=120)
    plt.close(fig)
    return file


def main(argv: list[str] | None = None) -> int:
    """Train (once), align with each class, measure the paths, merge the best; returns the exit status."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args, train_args = parse_args(argv)
    if args.points < 2 or args.max_examples < 1:
        raise UsageError("--points must be >= 2 (the path's two ends) and --max-examples >= 1")
    two_seeds().checked_args(["--out", str(args.out / "seeds"), *train_args])  # before anything is written
    args.out.mkdir(parents=True, exist_ok=True)
    folder = seeds(args, train_args)
    a, b = folder / "a", folder / "b"
    lambdas = [i / (args.points - 1) for i in range(args.points)]
    opts = {"lambdas": lambdas, "max_examples": args.max_examples, "device": args.device}
    rows, paths = [], {}
    for name, (kinds, from_data) in ROWS.items():
        aligned = args.out / "aligned" / name.split(":")[0] / "-".join(kinds)
        report = align(a, b, aligned, kinds, from_data, args)
        fig = path_figures(a, b, aligned, args.data, **opts)
        if not rows:
            rows.append(("plain (no alignment)", fig["plain"], 0.0, b))
            paths["plain"] = fig["plain"]
        rows.append((name, fig["aligned"], report["max_abs_logit_diff"], aligned))
        paths[name] = fig["aligned"]
    best = min(rows, key=lambda r: r[1]["barrier"])
    merged = merge_checkpoints("simple", [a, best[3]], args.out / "merged", overwrite=True)
    lines = ["| alignment of B onto A | barrier (nats) | midpoint loss | max abs dlogit of B' |", "|---|---|---|---|"]
    for name, p, diff, _ in rows:
        lines.append(f"| {name} | {p['barrier']:.4f} | {p['losses'][len(lambdas) // 2]:.4f} | {diff:.1e} |")
    text = "\n".join(lines)
    (args.out / "different_init.md").write_text(
        f"Two GPT-2 models trained from seeds 0 and 1 on {args.data}; end losses A {rows[0][1]['losses'][0]:.4f}, "
        f"B {rows[0][1]['losses'][-1]:.4f}.\n\n{text}\n\nMerged (simple, with {best[0]}): {merged}\n"
    )
    plot(paths, lambdas, args.out / "different_init.png")
    print(text)
    print(f"\nmerged A with B aligned by {best[0]}: {merged}; table and plot in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_script(main))
