"""The GPU check: CUDA results against CPU results, and timings of matching and merging on one GPU.

One command, on a machine with a CUDA device (< 8 min on one H100)::

    python bench/gpu_check.py --out DIR [--work /tmp/gpu-check] [--tokenizer PATH] [--skip timings]

writes ``DIR/gpu.md`` (the table committed as bench/results/gpu.md) and ``DIR/gpu.json``:

* parity (bench/gpu_parity.py): ``match`` for each kind and all together on bert / gpt2 / llama, Gram and Fisher
  statistics, every merge strategy, a fine-tune (bf16 autocast and fused AdamW on CUDA against float32 on the CPU)
  and ``evaluate``: largest relative difference against the stated tolerance;
* timings (CUDA, with the same machine's CPU beside them): ``match`` of a roberta-base pair (planted: a disguise
  with 1 % noise; independent: two random inits) as a library call and as the ``symfuse match`` command, RegMean
  K = 5 on roberta-base (float32 Grams), and a llama pair at 7B widths (2 layers, d 4096, FFN 11008, 32 / 8 heads,
  bf16) matched and merged, with peak GPU memory;
* the tests marked ``gpu`` (pytest -m gpu).

Every section runs even when an earlier one fails; a failure is a row with its error. Without CUDA the command
exits 2 with one line (the parity part runs on the CPU against itself in tests/bench/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import gpu_parity  # noqa: E402

ROOT = gpu_parity.ROOT
KINDS = ["rotation", "scaling", "ffn-permutation"]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    """Wall seconds of ``fn()`` with the GPU's queue drained before and after, and its result."""
    _sync()
    t0 = time.perf_counter()
    out = fn()
    _sync()
    return time.perf_counter() - t0, out


def peak_gib(fn: Callable[[], object]) -> tuple[float, float, object]:
    """``(seconds, peak GPU memory in GiB, result)`` of ``fn()``."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    s, out = timed(fn)
    return s, torch.cuda.max_memory_allocated() / 2**30, out


def stages(timings: dict[str, float]) -> str:
    """A report's per-stage seconds (summed over worker threads), largest first."""
    return ", ".join(f"{k} {v:.2f}" for k, v in sorted(timings.items(), key=lambda kv: -kv[1]))


def profile_top(fn: Callable[[], object], n: int = 12) -> str:
    """The ``n`` functions with the most own time (cProfile) while ``fn()`` runs, as ``name calls seconds``."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.runcall(fn)
    rows = sorted(pstats.Stats(prof).stats.items(), key=lambda kv: -kv[1][2])[:n]  # (file, line, name): (.., tt, ..)
    return "; ".join(f"{name} x{calls} {tt:.2f}" for (_, _, name), (_, calls, tt, _, _) in rows)


def match_roberta(work: Path) -> list[dict]:
    """``match`` of roberta-base pairs: library call on CUDA and on this machine's CPU, and the whole command."""
    import match_speed

    from symfuse.match import match_checkpoints

    rows = []
    for case in ("roberta-planted", "roberta-independent"):
        src, anc = match_speed.prepare(case, work)
        # the first CUDA call pays for kernel loading: the second is reported; default workers
        # (symfuse.runtime.module_workers: 8 on 16 threads) against 2, the default before
        for dev, workers in (("cuda", None), ("cuda", None), ("cuda", 2), ("cpu", None), ("cpu", 2)):
            out = work / f"{case}-{dev}-matched"
            shutil.rmtree(out, ignore_errors=True)
            call = partial(match_checkpoints, src, anc, out, KINDS, device=dev, verify="none", workers=workers)
            s, rep = timed(call)
            rows.append({"case": case, "device": dev, "workers": workers or "default", "call_s": s,
                         "match_s": rep["match_seconds"], "rel_after": rep["distance_after"] / rep["distance_before"],
                         "stages_s": stages(rep.get("timings", {}))})  # fmt: skip
        # the transforms alone (no output written, no distances): the part the rotation paper's 1.71 s times
        from symfuse.checkpoint import CheckpointReader
        from symfuse.match.checkpoints import match_all_modules

        with CheckpointReader(src) as s_reader, CheckpointReader(anc) as a_reader:
            s, _ = timed(partial(match_all_modules, s_reader, a_reader, KINDS))
        rows.append({"case": case, "device": "cpu", "workers": "transforms only", "call_s": s})
        for dev, verify in (("cuda", "stream"), ("cuda", "none"), ("cpu", "stream")):
            out = work / f"{case}-cmd"
            shutil.rmtree(out, ignore_errors=True)
            cmd = [sys.executable, "-m", "symfuse.cli", "match", str(src), str(anc), "--out", str(out), "--device",
                   dev, "--verify", verify]  # fmt: skip
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            rows.append({"case": case, "device": dev, "workers": f"command, verify {verify}",
                         "command_s": time.perf_counter() - t0, "rc": proc.returncode,
                         "stderr": proc.stderr[-300:]})  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", "import symfuse.cli"], capture_output=True, text=True, check=False)
    rows.append({"case": "import symfuse.cli (what every command pays first)", "command_s": time.perf_counter() - t0,
                 "rc": proc.returncode})  # fmt: skip
    return rows


def regmean_roberta(work: Path, k: int = 5) -> list[dict]:
    """RegMean of K roberta-base fine-tunes (synthetic float32 Grams, bench/merge_speed.py's recipe) on CUDA and CPU."""
    import merge_speed

    import symfuse.stats
    from symfuse.merge import merge_checkpoints

    root = work / "regmean"
    save = symfuse.stats.save_stats  # the fixture's Grams stored in float32 (half the bytes to write and read)
    symfuse.stats.save_stats = lambda t, file, meta: save(
        {n: x.float() for n, x in t.items()} if meta.get("kind") == "gram" else t, file, meta
    )
    try:
        merge_speed.setup(root, k)
    finally:
        symfuse.stats.save_stats = save
    models, stats = [root / f"m{i}" for i in range(k)], [root / f"s{i}" for i in range(k)]
    rows = []
    for dev, dtype in (("cuda", "float32"), ("cuda", "float32"), ("cuda", "float64"), ("cpu", "float32")):
        out = root / "out"
        shutil.rmtree(out, ignore_errors=True)
        s, _ = timed(partial(merge_checkpoints, "regmean", models, out, stats=stats, device=dev, dtype=dtype))
        rows.append({"case": f"regmean K={k} roberta-base, float32 Grams", "device": dev, "solve dtype": dtype,
                     "merge_s": s})  # fmt: skip
    from merge_floor import io_floor

    floor = io_floor(root, k)  # the bytes any merge of these files moves, read and written once (warm cache)
    rows.append({"case": f"regmean K={k}: I/O floor", "read_gb": floor["read_gb"], "read_s": floor["read_s"],
                 "preadv_s": floor["preadv_s"], "mmap_s": floor["mmap_s"], "write_s": floor["write_s"]})  # fmt: skip
    out = root / "out"
    shutil.rmtree(out, ignore_errors=True)
    top = profile_top(partial(merge_checkpoints, "regmean", models, out, stats=stats, device="cuda", dtype="float32"))
    rows.append({"case": f"regmean K={k}: where the CUDA merge's time goes (cProfile, own time)", "profile": top})
    return rows


def llama_7b_width(work: Path) -> list[dict]:
    """A 2-layer llama at 7B widths and its disguise, matched and merged on CUDA (time and peak GPU memory)."""
    import match_speed

    from symfuse.match import disguise_checkpoint, match_checkpoints
    from symfuse.merge import merge_checkpoints

    anchor = match_speed._llama(work / "llama7b-2", 2, seed=0)
    src = work / "llama7b-2-disguised"
    if not src.exists():
        disguise_checkpoint(anchor, src, seed=1, noise=0.01, kinds=[*KINDS, "head-permutation"], device="cuda")
    rows = []
    for verify in ("none", "none", "stream"):
        out = work / "llama-matched"
        shutil.rmtree(out, ignore_errors=True)
        call = partial(match_checkpoints, src, anchor, out, [*KINDS, "head-permutation"], device="cuda", verify=verify)
        s, gib, rep = peak_gib(call)
        rows.append({"case": "llama 7B widths, 2 layers, bf16", "step": f"match (verify {verify})", "seconds": s,
                     "match_s": rep["match_seconds"], "peak_gpu_gib": gib,
                     "rel_after": rep["distance_after"] / rep["distance_before"],
                     "logit_diff": rep["max_abs_logit_diff"]})  # fmt: skip
    for strategy, kw in (("simple", {}), ("ties", {"base": anchor})):
        out = work / f"llama-{strategy}"
        shutil.rmtree(out, ignore_errors=True)
        s, gib, _ = peak_gib(
            partial(merge_checkpoints, strategy, [work / "llama-matched", anchor], out, device="cuda", **kw)
        )
        rows.append({"case": "llama 7B widths, 2 layers, bf16", "step": f"merge {strategy}", "seconds": s,
                     "peak_gpu_gib": gib})  # fmt: skip
    return rows


def gpu_tests() -> list[dict]:
    """The tests marked ``gpu`` (they need CUDA), run with pytest."""
    files = ["tests/gpu", "tests/symfuse/test_device.py"]  # only these: the rest needs the dev / Prefect extras
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *files]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
    tail = proc.stdout.strip().splitlines()[-1:] if proc.stdout.strip() else [proc.stderr[-300:]]
    return [{"rc": proc.returncode, "seconds": time.perf_counter() - t0, "summary": tail[0] if tail else "",
             "output": proc.stdout[-3000:]}]  # fmt: skip


def section(name: str, fn: Callable[[], list[dict]], results: dict) -> None:
    """Run one section, keeping its rows or its error; print its time."""
    t0 = time.perf_counter()
    try:
        results[name] = fn()
    except Exception as exc:  # a failed section is reported; the next ones still run
        results[name] = [{"error": repr(exc)[:500], "trace": traceback.format_exc()[-3000:]}]
    print(f"[gpu_check] {name}: {time.perf_counter() - t0:.1f} s", flush=True)


def environment() -> dict:
    """What ran the check."""
    import transformers

    git = ["git", "rev-parse", "--short", "HEAD"]
    commit = subprocess.run(git, capture_output=True, text=True, cwd=ROOT, check=False)
    return {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "cpu_threads": torch.get_num_threads(),
        "commit": commit.stdout.strip() or "unknown",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for gpu.md and gpu.json")
    ap.add_argument("--work", type=Path, default=Path("/tmp/gpu-check"), help="scratch folder (models, statistics)")
    ap.add_argument("--tokenizer", type=Path, default=None, help="a BERT tokenizer folder (default: MiniLM's)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["parity", "timings", "tests"])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("error: bench/gpu_check.py: torch sees no CUDA device — run it on a GPU machine", file=sys.stderr)
        sys.exit(2)
    tokenizer = args.tokenizer or _minilm_tokenizer()
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {"environment": environment()}
    t0 = time.perf_counter()
    work = args.work
    sections = {
        "parity": lambda: gpu_parity.all_parity(work / "parity", "cpu", "cuda", tokenizer),
        "match roberta-base": lambda: match_roberta(work),
        "regmean roberta-base": lambda: regmean_roberta(work),
        "llama 7B widths": lambda: llama_7b_width(work),
        "gpu tests": gpu_tests,
    }
    group = {"parity": "parity", "gpu tests": "tests"}
    for name, fn in sections.items():
        if group.get(name, "timings") in args.skip:
            continue
        section(name, fn, results)
        results["seconds"] = time.perf_counter() - t0  # written after every section: a killed run keeps its part
        (args.out / "gpu.json").write_text(json.dumps(results, indent=1, default=str))
        (args.out / "gpu.md").write_text(report(results))
    print((args.out / "gpu.md").read_text())


def _minilm_tokenizer() -> Path:
    try:
        from symfuse.checkpoint import resolve_checkpoint

        return Path(resolve_checkpoint("minilm"))
    except Exception:
        return ROOT / ".gpuck" / "minilm-tokenizer"


def report(results: dict) -> str:
    """The markdown page of a check's results."""
    env = results["environment"]
    lines = ["# GPU check (bench/gpu_check.py)", "",
             f"{env['gpu']}; torch {env['torch']} (CUDA {env['cuda']}), transformers {env['transformers']}, "
             f"Python {env['python']}, {env['cpu_threads']} CPU threads; commit {env['commit']}; "
             f"{results['seconds']:.0f} s in all.", ""]  # fmt: skip
    for name, rows in results.items():
        if not isinstance(rows, list):
            continue
        lines += [f"## {name}", ""]
        keys = [k for k in dict.fromkeys(k for r in rows for k in r) if k not in ("trace", "output")]
        lines.append("| " + " | ".join(keys) + " |")
        lines.append("|" + "---|" * len(keys))
        for r in rows:
            lines.append("| " + " | ".join(_cell(r.get(k)) for k in keys) + " |")
        lines += [f"\n```\n{r['trace']}\n```" for r in rows if "trace" in r]
        lines.append("")
    return "\n".join(lines) + "\n"


def _cell(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, list):
        return ", ".join(_cell(x) for x in v)
    return str(v).replace("|", "/").replace("\n", " ") if v is not None else ""


if __name__ == "__main__":
    main()
