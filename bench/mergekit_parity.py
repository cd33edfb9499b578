"""Parity with mergekit 0.1.5: each method through ``mergekit-yaml`` and through ``symfuse merge``, tensor by tensor.

Three fine-tune-like copies of one tiny llama (``tests/tiny.py``: the base plus N(0, 0.02^2) deltas, float32,
``save_pretrained``) are merged by each method twice: by mergekit's YAML runner (``run_merge`` on each YAML, all in
one process of their own, on the CPU, ``out_dtype: float32``) and by ``symfuse merge`` (the CLI command, run in this
process). The table gives, per method, the largest relative difference over tensors
``||symfuse - mergekit|| / ||mergekit||``.

Random methods (dare_ties, dare_linear, della, della_linear) draw their masks from different generators (mergekit:
torch's global one; symfuse: one seeded per tensor and model), so they are compared in distribution: next to the
cross difference stand the seed-to-seed differences of each tool (seeds 0 and 1); a cross difference of the same
size means the same distribution, a much larger one a different method.

mergekit is not a symfuse dependency: install it into bench/.mergekit-lib (git-ignored), then run::

    python -m pip install --no-deps --target bench/.mergekit-lib mergekit==0.1.5 immutables peft sentencepiece protobuf
    python bench/mergekit_parity.py            # prints the table, writes bench/results/mergekit.md

A method whose symfuse strategy is not registered is reported "not in symfuse yet", one that fails with its error.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

from symfuse.merge.registry import MERGERS  # noqa: E402  (names only: no torch model code)
from tests.tiny import tiny_model  # noqa: E402

LIB = ROOT / "bench" / ".mergekit-lib"
W = [1.2, 0.8, 1.0]  # mergekit's per-model weights; they sum to K = 3, so symfuse's w_i K are the same numbers
SEEDS = (0, 1)


@dataclass
class Method:
    """One mergekit method and the symfuse merge that should equal it."""

    mk: str  # mergekit's merge_method
    sf: str  # symfuse's strategy
    models: list[tuple[str, dict[str, Any]]]  # (model key, mergekit per-model parameters)
    base: str | None = None  # mergekit's base_model key
    params: dict[str, Any] = field(default_factory=dict)  # mergekit's global parameters
    sf_models: list[str] | None = None  # symfuse's --models (default: the models)
    sf_base: str | None = None  # symfuse's --base
    sf_weights: list[float] | None = None
    sf_params: dict[str, Any] = field(default_factory=dict)
    seed_param: str | None = None  # random: the symfuse parameter holding the seed
    note: str = ""


def _fts(**per: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(f"ft{i}", {"weight": W[i], **per}) for i in range(3)]


def _task_vectors(mk: str, sf: str, per: dict[str, Any], sf_params: dict[str, Any], **kw: Any) -> Method:
    """A task-vector method: the three fine-tunes (mergekit per-model ``per`` and weights W) against the base."""
    return Method(mk, sf, _fts(**per), "base", sf_base="base", sf_weights=W, sf_params=sf_params, **kw)


DARE_NOTE = "same masks: mergekit rescales each task vector to its L1 norm, symfuse each entry by 1 / (1 - drop)"


def methods() -> list[Method]:
    """The methods compared, with their parameters."""
    three = ["ft0", "ft1", "ft2"]
    b, tv = "base", _task_vectors
    crumbs, della, topk = {"density": 0.6, "gamma": 0.05}, {"density": 0.5, "epsilon": 0.1}, {"select_topk": 0.5}
    return [
        Method("linear", "simple", _fts(), sf_weights=W),
        tv("task_arithmetic", "task-arithmetic", {}, {"lam": 1.0}),
        tv("ties", "ties", {"density": 0.5}, {"density": 0.5}),
        tv(
            "dare_ties",
            "dare",
            {"density": 0.5},
            {"drop": 0.5, "combine": "ties", "lam": 1.0},
            params={"normalize": True},
            seed_param="seed",
            note=f"{DARE_NOTE} (each matches its own formula to 6e-8 here); normalize: true (symfuse's disjoint mean)",
        ),
        tv(
            "dare_linear",
            "dare",
            {"density": 0.5},
            {"drop": 0.5, "combine": "task-arithmetic", "lam": 1.0},
            seed_param="seed",
            note=DARE_NOTE,
        ),
        tv("breadcrumbs", "breadcrumbs", crumbs, crumbs | {"lambda": 0.8}, params={"lambda": 0.8}),
        tv("breadcrumbs_ties", "breadcrumbs-ties", crumbs, crumbs),
        tv("della", "della", della, della, seed_param="seed"),
        tv("della_linear", "della-linear", della, della, seed_param="seed"),
        Method("sce", "sce", [(m, {}) for m in three], b, topk, sf_base=b, sf_params=topk),
        Method("slerp", "slerp", [("ft0", {}), ("ft1", {})], "ft0", {"t": 0.3}, sf_params={"t": 0.3}),
        Method("nuslerp", "nuslerp", [("ft0", {"weight": 0.3}), ("ft1", {"weight": 0.7})], sf_weights=[0.3, 0.7]),
        Method("multislerp", "multislerp", _fts(), sf_weights=W),
        Method("karcher", "karcher", [(m, {}) for m in three]),
        Method("model_stock", "model-stock", [(m, {}) for m in three], b, sf_base=b),
        Method("nearswap", "nearswap", [("ft0", {}), ("ft1", {})], "ft0", {"t": 0.01}, sf_params={"t": 0.01}),
        Method("arcee_fusion", "arcee-fusion", [("base", {}), ("ft0", {})], "base", sf_models=["base", "ft0"]),
    ]


def make_models(root: Path) -> dict[str, Path]:
    """The tiny llama base and three fine-tune-like copies (base + small random deltas), float32."""
    paths = {}
    for key, seed in (("base", None), ("ft0", 1), ("ft1", 2), ("ft2", 3)):
        model = tiny_model("llama", seed=0, head="lm")
        if seed is not None:
            g = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.02 * torch.randn(p.shape, generator=g))
        paths[key] = root / key
        model.save_pretrained(paths[key])
    return paths


def mergekit_config(m: Method, paths: dict[str, Path]) -> dict[str, Any]:
    """``m`` as a mergekit YAML document."""
    config: dict[str, Any] = {
        "merge_method": m.mk,
        "models": [{"model": str(paths[k]), **({"parameters": p} if p else {})} for k, p in m.models],
        "dtype": "float32",
        "out_dtype": "float32",
    }
    if m.base is not None:
        config["base_model"] = str(paths[m.base])
    if m.params:
        config["parameters"] = m.params
    return config


def run_mergekit(jobs: list[tuple[dict[str, Any], Path, int, bool]], paths: dict[str, Path]) -> dict[Path, tuple]:
    """mergekit on each ``(config, out, seed, inject masks)``, all in one process of their own.

    That process (bench/mergekit_driver.py) has only bench/.mergekit-lib on its path; one for all merges, as
    mergekit's start (importing transformers and peft) is the slow part.

    Returns:
        ``{out: (seconds, masks injected, error or "")}``.
    """
    args = []
    for config, out, seed, inject in jobs:
        spec = out.with_suffix(".yaml")
        spec.write_text(yaml.safe_dump(config, sort_keys=False))
        args += [str(spec), str(out), str(seed), "1" if inject else "0"]
    index = {str(paths[k]): i for i, k in enumerate(("ft0", "ft1", "ft2"))}  # symfuse's --models order
    env = dict(os.environ, PYTHONPATH=str(LIB), MK_INDEX=json.dumps(index), HF_HUB_OFFLINE="1")
    driver = ROOT / "bench" / "mergekit_driver.py"
    res = subprocess.run([sys.executable, str(driver), *args], env=env, capture_output=True, text=True, check=False)
    done = {}
    for line in res.stdout.splitlines():
        if line.startswith("RESULT\t"):
            _, out, secs, draws, err = [*line.split("\t"), ""][:5]
            done[Path(out)] = (float(secs), int(draws), err)
    last = (res.stderr.strip().splitlines() or ["(no message)"])[-1][:160]
    return {out: done.get(out, (0.0, 0, f"mergekit crashed: {last}")) for _, out, _, _ in jobs}


def run_symfuse(m: Method, paths: dict[str, Path], out: Path, seed: int) -> tuple[float, str]:
    """``symfuse merge`` on ``m`` (the CLI command, in this process): ``(seconds, error or "")``."""
    from typer.testing import CliRunner

    from symfuse.cli import app
    from symfuse.cli import commands as _commands  # noqa: F401  (registers the commands)

    models = m.sf_models or [k for k, _ in m.models]
    cmd = ["merge", "--strategy", m.sf, "--models", *(str(paths[k]) for k in models), "--device", "cpu"]
    if m.sf_base:
        cmd += ["--base", str(paths[m.sf_base])]
    if m.sf_weights:
        cmd += ["--weights", *map(str, m.sf_weights)]
    for k, v in (m.sf_params | ({m.seed_param: seed} if m.seed_param else {})).items():
        cmd += ["--param", f"{k}={v}"]
    t0 = time.perf_counter()
    res = CliRunner().invoke(app, [*cmd, "--out", str(out)])
    err = "" if res.exit_code == 0 else ((res.output.strip().splitlines() or [repr(res.exception)])[-1][:160])
    return time.perf_counter() - t0, err


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out |= load_file(f)
    return out


def rel_diff(a_dir: Path, b_dir: Path) -> tuple[float, str]:
    """The largest ``||a - b|| / ||b||`` over the tensors both folders hold (``b`` the reference), and its tensor."""
    a, b = _tensors(a_dir), _tensors(b_dir)
    worst, where = 0.0, "-"
    for name in sorted(a.keys() & b.keys()):
        x, y = a[name].double(), b[name].double()
        d = float((x - y).norm() / y.norm()) if y.norm() > 0 else float((x - y).norm())
        if d > worst:
            worst, where = d, name
    if a.keys() != b.keys():
        where += f" (tensor sets differ: {len(a.keys() ^ b.keys())})"
    return worst, where


def compare(todo: list[Method], paths: dict[str, Path], work: Path) -> list[dict[str, Any]]:
    """The table's rows: every method through mergekit (one process) and symfuse, then compared."""
    rows: list[dict[str, Any]] = [{"method": m.mk, "strategy": m.sf, "note": m.note} for m in todo]
    seeds = {m.mk: SEEDS if m.seed_param else SEEDS[:1] for m in todo}
    runnable = [m for m in todo if m.sf in MERGERS.names()]
    jobs = [(mergekit_config(m, paths), work / f"{m.mk}-mk{s}", s, False) for m in runnable for s in seeds[m.mk]]
    jobs += [(mergekit_config(m, paths), work / f"{m.mk}-mkmask", 0, True) for m in runnable if m.seed_param]
    mk = run_mergekit(jobs, paths)
    for m, row in zip(todo, rows, strict=True):
        if m not in runnable:
            row["status"] = "not in symfuse yet"
            continue
        for s in seeds[m.mk]:
            t_mk, _, err = mk[work / f"{m.mk}-mk{s}"]
            if err:
                row["status"] = f"mergekit failed: {err}"
                break
            t_sf, err = run_symfuse(m, paths, work / f"{m.mk}-sf{s}", s)
            if err:
                row["status"] = f"symfuse failed: {err}"
                break
            row.setdefault("seconds", (t_mk, t_sf))
        if "status" in row:
            continue
        row["diff"], row["where"] = rel_diff(work / f"{m.mk}-sf0", work / f"{m.mk}-mk0")
        if m.seed_param:
            row["mk_seeds"] = rel_diff(work / f"{m.mk}-mk1", work / f"{m.mk}-mk0")[0]
            row["sf_seeds"] = rel_diff(work / f"{m.mk}-sf1", work / f"{m.mk}-sf0")[0]
            same = row["diff"] < 1.5 * max(row["mk_seeds"], row["sf_seeds"])
            row["status"] = "in distribution" if same else "DIFFERS"
            _, draws, err = mk[work / f"{m.mk}-mkmask"]
            if err or not draws:
                row["masks"] = f"injection failed: {err or 'no masks drawn'}"
            else:
                masks = rel_diff(work / f"{m.mk}-sf0", work / f"{m.mk}-mkmask")[0]
                row["masks"] = f"{masks:.2e}"
                if masks < 1e-5:
                    row["status"] += "; equal on the same masks"
        else:
            row["status"] = "equal" if row["diff"] < 1e-5 else "DIFFERS"
        print(f"{m.mk}: {row['status']} {row['diff']:.2e}", flush=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table."""
    lines = [
        "| mergekit method | symfuse strategy | max rel. diff | same masks | seed-to-seed (mergekit / symfuse) | "
        "verdict | worst tensor | s (mergekit / symfuse) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        diff = f"{r['diff']:.2e}" if "diff" in r else "-"
        seeds = f"{r['mk_seeds']:.2e} / {r['sf_seeds']:.2e}" if "mk_seeds" in r else "-"
        secs = "{:.1f} / {:.1f}".format(*r["seconds"]) if "seconds" in r else "-"
        lines.append(
            f"| {r['method']} | {r['strategy']} | {diff} | {r.get('masks', '-')} | {seeds} | {r['status']} | "
            f"{r.get('where', '-')} | {secs} |"
        )
    return "\n".join(lines)


def main() -> None:
    """Run every method through both tools, print the table and write the results file."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=ROOT / "bench" / "out" / "mergekit_parity")
    ap.add_argument("--results", type=Path, default=ROOT / "bench" / "results" / "mergekit.md")
    ap.add_argument("--only", nargs="*", help="mergekit method names to run (default: all)")
    args = ap.parse_args()
    if not (LIB / "mergekit").is_dir():
        sys.exit(f"mergekit is not installed in {LIB}: see this script's docstring")
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    paths = make_models(args.work / "models")
    rows = compare([m for m in methods() if not args.only or m.mk in args.only], paths, args.work)
    text = table(rows)
    print(text)
    if not args.only:
        args.results.write_text(RESULTS.format(table=text, notes=_notes(rows), torch=torch.__version__))


def _notes(rows: list[dict[str, Any]]) -> str:
    return "\n".join(f"* {r['method']}: {r['note']}" for r in rows if r.get("note")) or "* (none)"


RESULTS = """# Parity with mergekit 0.1.5

Each method merged three fine-tune-like copies of one tiny llama (hidden 32, 2 layers, vocab 64; the base plus
N(0, 0.02^2) deltas; float32) through mergekit 0.1.5's YAML runner (CPU, `out_dtype: float32`) and through
`symfuse merge`; "max rel. diff" is the largest `||symfuse - mergekit|| / ||mergekit||` over the tensors. Weights
1.2, 0.8, 1.0 where the method takes them (they sum to K = 3: symfuse normalises weights and scales by K). Random
methods draw different masks in the two tools (mergekit: torch's global generator; symfuse: seeded per tensor and
model): they are compared in distribution, the cross difference beside each tool's own seed-to-seed difference
(seeds 0 and 1), "in distribution" when it is below 1.5 times the larger; and on the same masks ("same masks": a
mergekit run whose `torch.bernoulli(p)` in `mergekit.sparsify` was replaced by `u >= 1 - p` with symfuse's draws
`u` for that tensor and model, bench/mergekit_driver.py). The deltas here are as large as the tiny weights, so two
draws of one random method already differ by about the merged tensor's size (the seed-to-seed column, ~1): that
check is coarse, the same-masks column is the sharp one. Measured on the CPU, torch {torch}.

{table}

Notes:
{notes}

Reproduce (mergekit is installed outside the project's dependencies, into a git-ignored folder):

```
python -m pip install --no-deps --target bench/.mergekit-lib mergekit==0.1.5 immutables peft sentencepiece protobuf
python bench/mergekit_parity.py
```
"""


if __name__ == "__main__":
    main()
