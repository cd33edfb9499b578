"""Wall time and quality of the README's main job: ``python -m flows [--quick]`` on a fresh store, several runs.

Each run starts the demo as a user does (a new interpreter, ephemeral Prefect, an empty local store) and records the
command's wall time, the pipeline's own wall time (printed by the demo), the per-stage task seconds of the report,
and the best merge's in-domain Matthews' correlation (mean over the in-domain test sets, read from the stored
evaluation records) next to the individual models'. Targets (issue 17 / 15): quick < 90 s, full < 8 min on this
2-core CPU; the best merge's in-domain Matthews > 0.1.

Usage: python bench/demo_speed.py [--quick] [--runs 3] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from symfuse.config import RunConfig
from symfuse.store import ArtifactStore, layout


def matthews_by_model(store: Path, config: RunConfig) -> dict[str, float]:
    """Mean in-domain Matthews per evaluated model (fine-tuned or merged) of the run in ``store``."""
    st = ArtifactStore(str(store))
    out: dict[str, list[float]] = {}
    for model_dir in sorted((store / "runs" / config.run_id / "eval").iterdir()):
        for name in config.dataset_names:
            record = st.get_json(layout.eval_key(config.run_id, model_dir.name, name))
            if record["domain"] == "in" and record["metrics"].get("matthews") is not None:
                out.setdefault(model_dir.name, []).append(record["metrics"]["matthews"])
    return {m: sum(v) / len(v) for m, v in out.items()}


def one_run(quick: bool, workdir: Path, i: int) -> dict:
    """One fresh demo run: wall seconds, the pipeline's seconds, stage seconds and Matthews per model."""
    store = workdir / f"store-{i}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1",
           "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120"}  # fmt: skip
    cmd = [sys.executable, "-m", "flows", *(["--quick"] if quick else []), "--store", str(store)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise SystemExit(f"demo run {i} failed (exit {proc.returncode}):\n{out[-3000:]}")
    config = RunConfig.demo(quick=quick)
    pipeline = float(re.search(r"pipeline wall time (\d+) s", out).group(1))
    report = ArtifactStore(str(store)).local_cache(layout.report_key(config.run_id)) / "report.md"
    stages = re.search(r"## Timings \(seconds of task work\)\n\n(.*?)\n\n", report.read_text(), re.S)
    return {"wall": wall, "pipeline": pipeline, "stages": stages.group(1) if stages else "",
            "matthews": matthews_by_model(store, config)}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the quick demo (default: the full one)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--workdir", help="where the stores go (default: a temporary folder, removed)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(args.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        runs = []
        for i in range(1, args.runs + 1):
            r = one_run(args.quick, workdir, i)
            runs.append(r)
            print(f"run {i}: {r['wall']:.1f} s wall (pipeline {r['pipeline']:.0f} s)", flush=True)
    walls = [r["wall"] for r in runs]
    target = 90 if args.quick else 480
    print(f"\n{'quick' if args.quick else 'full'} demo, {len(runs)} fresh runs, load {os.getloadavg()[0]:.1f} after")
    print(f"| wall s median | range | target | met |\n|---:|---|---:|---|\n"
          f"| {statistics.median(walls):.1f} | {min(walls):.1f}-{max(walls):.1f} | < {target} | "
          f"{'yes' if statistics.median(walls) < target else 'NO'} |")  # fmt: skip
    mcc = runs[-1]["matthews"]
    print("\nin-domain Matthews (mean over the training sets' test splits), last run:\n")
    print("| model | Matthews |\n|---|---:|")
    for m, v in sorted(mcc.items(), key=lambda kv: -kv[1]):
        print(f"| {m} | {v:.3f} |")
    merges = {m: v for m, v in mcc.items() if m not in RunConfig.demo(quick=args.quick).dataset_names}
    best = max(merges, key=merges.get)
    print(f"\nbest merge: {best} {merges[best]:.3f} (target > 0.1: {'met' if merges[best] > 0.1 else 'NOT met'})")
    print(f"\nstage seconds (task work), last run:\n\n{runs[-1]['stages']}")


if __name__ == "__main__":
    main()
