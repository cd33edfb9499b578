"""The quick pipeline on one GPU through the local stack: a pipeline worker and a stage worker, both process workers.

One command, on a machine with a CUDA device and Prefect (carried as wheels on the device machine)::

    python bench/gpu_pipeline.py --out DIR [--work /tmp/gpu-pipeline] [--tokenizer PATH] [--port 4620]

It starts ``deployments/stack.py`` on a fresh home (server, deployments, one ``gpu`` pool pipeline worker and one
stage worker for the GPU, ``--limit 1``), runs the quick demo's settings through the ``fusion-pipeline`` deployment
with ``device: cuda`` and ``fan_out: deployments``, then stops the stack and writes ``DIR/pipeline.json``: the run's
state and wall time, each stage run's window, the device its heavy task computed on (its ``holding device slot``
log line) and the merges' in-domain metrics. The base model is a small random BERT (4 layers, d 256) with MiniLM's
tokenizer: MiniLM's weights do not fit the device call's 64 MiB with Prefect's wheels beside them. The check is of
the machinery on a GPU (stages on CUDA, slots, artifacts), not of accuracy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SLOT = re.compile(r"holding device slot (\S+): computing on (\S+)")
TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def make_base(folder: Path, tokenizer: Path) -> Path:
    """A random BERT (4 layers, d 256, 4 heads, FFN 1024) with the tokenizer's vocabulary, saved to ``folder``."""
    import torch
    from transformers import BertConfig, BertModel

    if (folder / "config.json").exists():
        return folder
    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                        intermediate_size=1024, max_position_embeddings=128)  # fmt: skip
    BertModel(config).save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy2(tokenizer / name, folder / name)
    return folder


def run_config(base: Path, store: Path, device: str = "cuda") -> dict:
    """The quick demo's settings on ``base``, on ``device``, fanned out over the stage deployments."""
    from symfuse.config import RunConfig

    data = RunConfig.demo(quick=True).model_dump(mode="json")
    data.update(run_id="gpu-quick", base_model=str(base), device=device, fan_out="deployments", store_root=str(store))
    return RunConfig.model_validate(data).model_dump(mode="json")


async def stage_runs() -> list[dict]:
    """Every flow run of the server (the pipeline and its stage runs): name, state, window, device of its slot."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    async with get_client() as client:
        runs = [r for r in await client.read_flow_runs() if r.start_time]  # not the scheduled re-merges
        ids = [r.id for r in runs]
        logs: list = []
        while page := await client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=ids)),
                                              limit=200, offset=len(logs)):  # fmt: skip
            logs += page
    where: dict = {}
    for line in logs:
        if m := SLOT.search(line.message):
            where.setdefault(line.flow_run_id, []).append(f"{m.group(1)} -> {m.group(2)}")
    rows = []
    for r in sorted(runs, key=lambda r: r.start_time):
        seconds = (r.end_time - r.start_time).total_seconds() if r.start_time and r.end_time else None
        rows.append({"run": r.name, "state": r.state.name if r.state else None,
                     "start": r.start_time.isoformat() if r.start_time else None, "seconds": seconds,
                     "slots": where.get(r.id, [])})  # fmt: skip
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/gpu-pipeline"))
    ap.add_argument("--tokenizer", type=Path, default=ROOT / ".gpuck" / "minilm-tokenizer")
    ap.add_argument("--port", type=int, default=4620)
    ap.add_argument("--timeout", type=float, default=420, help="seconds the run may take")
    ap.add_argument("--device", default="cuda", help="the run's device (cpu: a dry run of this script)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(args.work, ignore_errors=True)
    base = make_base(args.work / "base", args.tokenizer)
    home = args.work / "stack"
    api = f"http://127.0.0.1:{args.port}/api"
    env = {**os.environ, "SYMFUSE_STORE": str(args.work / "store"), "SYMFUSE_CACHE": str(args.work / "cache"),
           "PREFECT_API_URL": api, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "PREFECT_LOGGING_EXTRA_LOGGERS": "symfuse,tasks"}  # fmt: skip
    os.environ.update(env)
    result: dict = {"base": "random BERT, 4 layers, d 256, MiniLM's tokenizer"}
    t0 = time.perf_counter()
    stack = [sys.executable, "deployments/stack.py"]
    started = subprocess.run([*stack, "start", "--port", str(args.port), "--home", str(home)], cwd=ROOT, env=env,
                             capture_output=True, text=True, check=False)  # fmt: skip
    result["stack_start_s"] = time.perf_counter() - t0
    result["stack_start"] = (started.stdout + started.stderr)[-2000:]
    try:
        if started.returncode == 0:
            params = json.dumps({"config": run_config(base, args.work / "store", args.device)})
            t1 = time.perf_counter()
            run = subprocess.run(
                [sys.executable, "-m", "prefect", "deployment", "run", "fusion-pipeline/fusion-pipeline", "--params",
                 params, "--watch", "--watch-timeout", str(int(args.timeout))],
                cwd=ROOT, env=env, capture_output=True, text=True, check=False, timeout=args.timeout + 60,
            )  # fmt: skip
            result["pipeline_s"] = time.perf_counter() - t1
            result["pipeline_rc"] = run.returncode
            result["pipeline_tail"] = (run.stdout + run.stderr)[-3000:]
            result["runs"] = asyncio.run(stage_runs())
            for csv in sorted((args.work / "store").glob("runs/gpu-quick/report/.v/*/metrics.csv"))[-1:]:
                result["metrics_csv"] = csv.read_text()  # the published report's table
    finally:
        subprocess.run([*stack, "stop", "--home", str(home)], cwd=ROOT, env=env, capture_output=True, check=False)
        logs = home / "logs"
        result["log_tails"] = {p.name: p.read_text(errors="replace")[-1500:] for p in sorted(logs.glob("*.log"))
                               } if logs.exists() else {}  # fmt: skip
        (args.out / "pipeline.json").write_text(json.dumps(result, indent=1, default=str))
    ok = result.get("pipeline_rc") == 0
    print(f"[gpu_pipeline] {'completed' if ok else 'FAILED'} in {result.get('pipeline_s', 0):.0f} s "
          f"(stack start {result['stack_start_s']:.0f} s)")  # fmt: skip
    for r in result.get("runs", []):
        print(f"  {r['run']}: {r['state']} {r['seconds']} s {r['slots']}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
