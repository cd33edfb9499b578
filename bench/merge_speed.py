"""Merge speed and memory: RegMean / Fisher over K roberta-base-shaped models, Gram throughput on MiniLM.

    python bench/merge_speed.py [--root /tmp/symfuse-merge-bench] [--ks 2 5] [--repeat 1] [--gram-examples 512]
    python bench/merge_speed.py --job ratio [--ks 5] [--rounds 5] [--variants "regmean float32"]

``--job ratio`` (issue 17): per round, the arithmetic floor (``--job floor``) and the merge, each in a fresh
subprocess, one after the other; prints per round and then the median (range) of merge s / floor s and of the
merge's peak RSS (ru_maxrss of its process, imports included).

Builds (once, cached under --root) a random roberta-base-shaped base (12 x 768, d_ffn 3072, vocab 50265, 2-label
head) and K FINE-TUNES of it: base + a small random delta (``||delta|| / ||W|| = DELTA = 1e-2`` per tensor), as
when merging models fine-tuned from one checkpoint. Statistics have the real file format: Grams (float64, and a
float32-stored copy) with a decaying spectrum, outlier features and a per-model perturbation (condition number
~1e4, q / k / v sharing one input recorded as ``same_input``), Fisher (float32). Each merge runs in a FRESH
subprocess (peak RSS = that process's ru_maxrss, imports included; CPU = its user + system time) after the input
files were read once (warm page cache). Every RegMean variant is compared with the float64 solve (max |diff| /
max |W| over the linear weights); a second error table merges K INDEPENDENT random layers (deltas as large as the
weights) with the same Grams, where bfloat16 products must not be used.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from merge_floor import arithmetic_floor, io_floor, roberta_config  # a sibling: bench scripts run from bench/

ROOT = Path("/tmp/symfuse-merge-bench")
VERSION = 3  # bump when the synthetic data change
DELTA = 0.01  # relative size of each fine-tune's delta from the base


def _gram(n: int, layer: int, i: int):
    """A realistic-ish input Gram (n, n): decaying spectrum, a few outlier features, shared across models.

    Every model's Gram of one layer shares a common low-rank part and diagonal (the same base network reads
    similar inputs); each model adds its own perturbation (its own dataset). Condition number ~1e4.
    """
    import torch

    common = torch.Generator().manual_seed(1000 + 7 * layer + n)
    own = torch.Generator().manual_seed(10_000 + 1000 * i + 7 * layer + n)
    u = torch.randn(n, 32, generator=common, dtype=torch.float64) * torch.logspace(0, -2, 32, dtype=torch.float64)
    u = u + 0.3 * torch.randn(n, 32, generator=own, dtype=torch.float64) * u.abs().mean()
    d = torch.logspace(-2, 0, n, dtype=torch.float64)[torch.randperm(n, generator=common)]
    d = d * (1 + 0.2 * torch.rand(n, generator=own, dtype=torch.float64))
    d[:4] *= 100  # outlier features (as in RoBERTa's residual stream)
    return torch.diag(d) + 10 * u @ u.T / n**0.5


def setup(root: Path, k: int) -> None:
    """K fine-tunes of one base: base + a small random delta (||delta|| / ||W|| = DELTA per tensor)."""
    import torch
    import transformers as T
    from safetensors.torch import load_file, save_file

    from symfuse.stats import linear_modules, save_stats

    if (root / f"ready-{VERSION}-{k}").exists():
        return
    torch.manual_seed(0)
    model = T.RobertaForSequenceClassification(roberta_config())
    lins = {n: m.in_features for n, m in linear_modules(model).items()}
    src = root / "base"
    if not src.exists():
        model.save_pretrained(src)
    base_sd = load_file(str(src / "model.safetensors"))
    for i in range(k):
        folder = root / f"m{i}"
        g = torch.Generator().manual_seed(100 + i)
        if not folder.exists():
            folder.mkdir(parents=True)
            shutil.copy(src / "config.json", folder / "config.json")
            sd = {}
            for n, t in base_sd.items():
                if t.is_floating_point():
                    scale = DELTA * max(float(t.float().pow(2).mean().sqrt()), 0.02)
                    t = t + scale * torch.randn(t.shape, generator=g)
                sd[n] = t
            save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
        st = root / f"s{i}"
        if not (st / "gram.safetensors").exists():
            grams, shared = {}, {}
            for name, n_in in lins.items():
                parent = name.rsplit(".", 1)[0]  # q / k / v share their input, as in a real model
                key = parent if name.endswith(("query", "key", "value")) else name
                layer = int(name.split("layer.")[1].split(".")[0]) if "layer." in name else 99
                if key not in shared:
                    shared[key] = _gram(n_in, layer * 4 + len(shared) % 4, i)
                grams[name] = shared[key].clone()
            same = {n: n.rsplit(".", 1)[0] + ".query" for n in grams if n.endswith((".key", ".value"))}
            meta = {"kind": "gram", "conv1d": [], "dataset": f"d{i}", "same_input": same}
            save_stats(grams, st / "gram.safetensors", meta)
        if not (st / "fisher.safetensors").exists():
            fisher = {n: torch.rand(p.shape, generator=g) ** 4 for n, p in model.named_parameters()}
            save_stats(fisher, st / "fisher.safetensors", {"kind": "fisher", "dataset": f"d{i}"})
    (root / f"ready-{VERSION}-{k}").touch()


VARIANTS = {  # name -> (stats folder suffix, merge params)
    "regmean float64": ("", {"dtype": "float64"}),
    "regmean float32": ("", {"dtype": "float32"}),
    "regmean float32 bf16": ("", {"dtype": "float32", "delta_dtype": "bfloat16"}),
    "regmean float32 auto": ("", {"dtype": "float32", "delta_dtype": "auto"}),
    "regmean float32, f32 Grams": ("-f32", {"dtype": "float32"}),
    "fisher": ("", {}),
}


def setup_f32(root: Path, k: int) -> None:
    """float32-stored copies of the Gram files (``s{i}-f32``)."""
    from symfuse.stats import StatsFile, save_stats

    for i in range(k):
        dst = root / f"s{i}-f32" / "gram.safetensors"
        if not dst.exists():
            sf = StatsFile(root / f"s{i}" / "gram.safetensors")
            save_stats({n: sf.get(n).float() for n in sf.keys()}, dst, sf.meta)  # noqa: SIM118


def one(root: Path, variant: str, k: int) -> dict:
    from symfuse.merge import merge_checkpoints

    suffix, params = VARIANTS[variant]
    strategy = variant.split(maxsplit=1)[0]
    out = root / f"out-{k}-{variant.replace(' ', '_').replace(',', '')}"
    stats = [root / f"s{i}{suffix}" for i in range(k)]
    if strategy == "regmean":
        stats = [s / "gram.safetensors" for s in stats]
    shutil.rmtree(out, ignore_errors=True)  # the merge into a fresh folder: deleting an old result is not timed
    # transformers' config machinery (1-3 s here) is imported once per process, as the interpreter is started
    # once: a worker that merges again pays it once. Imported before the clock starts and reported beside it.
    t = time.perf_counter()
    from transformers import AutoConfig

    AutoConfig.from_pretrained(str(root / "m0"))
    imports = time.perf_counter() - t
    usage = resource.getrusage(resource.RUSAGE_SELF)
    c = usage.ru_utime + usage.ru_stime
    t = time.perf_counter()
    merge_checkpoints(strategy, [root / f"m{i}" for i in range(k)], out, stats=stats, **params)
    seconds = time.perf_counter() - t
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu = usage.ru_utime + usage.ru_stime - c
    rss = usage.ru_maxrss / 1024  # MiB (Linux: KiB)
    counters = json.loads((out / "symfuse_report.json").read_text())["counters"]
    return {"variant": variant, "k": k, "seconds": seconds, "cpu": cpu, "peak_rss_mib": rss, "counters": counters,
            "imports_s": imports}  # fmt: skip


def merge_errors(root: Path, k: int) -> dict[str, float]:
    """Max |diff| / max |W| over linear weights, each RegMean variant against the float64 solve."""
    from symfuse.merge import StreamingReader

    ref = StreamingReader(root / f"out-{k}-regmean_float64")
    errs = {}
    for variant in VARIANTS:
        if not variant.startswith("regmean") or variant == "regmean float64":
            continue
        folder = root / f"out-{k}-{variant.replace(' ', '_').replace(',', '')}"
        if not folder.exists():  # variant not run (--variants)
            continue
        other = StreamingReader(folder)
        worst = 0.0
        for n in ref.names():
            t = ref.get(n)
            if n.endswith(".weight") and t.dim() == 2 and "embeddings" not in n:
                t = t.double()
                worst = max(worst, float((other.get(n).double() - t).abs().max() / t.abs().max()))
        errs[variant] = worst
    return errs


def layer_errors(root: Path, k: int) -> dict[str, dict[str, float]]:
    """Errors on one layer (ffn out, 3072 inputs, and ffn in, 768) for fine-tunes and for independent weights."""
    import torch

    from symfuse.merge.regmean import gram_system, regmean_apply
    from symfuse.stats import StatsFile

    g = torch.Generator().manual_seed(5)
    out = {}
    for module, shape in (("output.dense", (768, 3072)), ("intermediate.dense", (3072, 768))):
        key = f"roberta.encoder.layer.5.{module}"
        grams = [StatsFile(root / f"s{i}" / "gram.safetensors").get(key) for i in range(k)]
        base = torch.randn(shape, generator=g) * 0.05
        inputs = {
            "fine-tunes": [base + 1e-2 * 0.05 * torch.randn(shape, generator=g) for _ in range(k)],
            "independent": [torch.randn(shape, generator=g) * 0.05 for _ in range(k)],
        }
        ref = gram_system(grams, None, 0.9, torch.float64)
        lo = gram_system([x.float() for x in grams], None, 0.9, torch.float32)
        for what, ws in inputs.items():
            exact, _ = regmean_apply(ref, [w.double() for w in ws])
            scale = float(exact.abs().max())
            row = {}
            for mode in ("same", "bfloat16", "auto"):
                got, used = regmean_apply(lo, ws, delta_dtype=mode)
                row[f"{mode} ({used})"] = float((got.double() - exact).abs().max()) / scale
            out[f"{module} {what}, cond >= {lo.cond:.0e}"] = row
    return out


def gram_throughput(n_examples: int) -> dict:
    import torch

    from symfuse.data import load_task_dataset, make_batches
    from symfuse.stats import collect_gram, load_model

    model = load_model("minilm")
    batches = make_batches(load_task_dataset("dair_emotion"), "minilm", "train", 32, 128, n_examples, 13)
    out = {}
    for dtype in ("float32", "float64"):
        t = time.perf_counter()
        g = collect_gram(model, batches, progress=False, matmul_dtype=getattr(torch, dtype))
        s = time.perf_counter() - t
        out[dtype] = {"tokens": g.n_tokens, "seconds": s, "tokens_per_s": g.n_tokens / s}
    return out


def ratio_table(args: argparse.Namespace, child) -> None:
    """Rounds of (floor, merge) in fresh processes; median (range) of merge / floor and of peak RSS.

    Also the fastest merge over the fastest floor: on a shared CPU a round's merge and floor meet different loads,
    and the floor is itself a best of 3 per primitive, so the two minima are the like-for-like pair.
    """
    import statistics

    child("--job", "setup")
    for f in sorted(args.root.glob("[ms]*/*.safetensors")):  # warm the page cache
        with open(f, "rb") as fh:
            while fh.read(1 << 26):
                pass
    variants = args.variants if args.variants != list(VARIANTS) else ["regmean float32"]
    k = max(args.ks)
    for variant in variants:
        ratios, rss, secs, floors, ios, full, imports = [], [], [], [], [], [], []
        for i in range(args.rounds):
            f = json.loads(child("--job", "floor"))[str(k)]
            floor = f["floor_s"]
            io = json.loads(child("--job", "iofloor", f"--suffix={VARIANTS[variant][0]}"))[str(k)]  # its own Grams
            r = json.loads(child("--one", variant, str(k)))
            ratios.append(r["seconds"] / floor)
            rss.append(r["peak_rss_mib"])
            secs.append(r["seconds"])
            floors.append(floor)
            ios.append(io["read_s"] + io["write_s"])
            full.append(r["seconds"] / (floor + ios[-1]))
            imports.append(r["imports_s"])
            print(f"round {i + 1}: {variant} K={k}: merge {r['seconds']:.1f} s (CPU {r['cpu']:.1f} s), floor "
                  f"{floor:.1f} s, ratio {ratios[-1]:.2f}; I/O {ios[-1]:.1f} s (read {io['read_gb']:.1f} GB in "
                  f"{io['read_s']:.1f} s: preadv {io['preadv_s']:.1f} s, mapped {io['mmap_s']:.1f} s; write "
                  f"{io['write_gb']:.2f} GB in {io['write_s']:.2f} s), "
                  f"merge / (floor + I/O) {full[-1]:.2f}; (floor + I/O) / floor "
                  f"{(floor + ios[-1]) / floor:.2f}; peak RSS {rss[-1]:.0f} MiB; imports before the clock "
                  f"{imports[-1]:.1f} s", flush=True)  # fmt: skip

        def med(xs: list[float], f: str) -> str:
            return f"{statistics.median(xs):{f}} ({min(xs):{f}}-{max(xs):{f}})"

        floor_io = [(f_ + io_) / f_ for f_, io_ in zip(floors, ios, strict=True)]
        print(
            "\n| merge | K | merge s | floor s | merge / floor | I/O s | merge / (floor + I/O) | (floor + I/O) / floor "
            "| peak RSS MiB | imports s (not timed) | fastest merge / fastest floor |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        print(f"| {variant} | {k} | {med(secs, '.1f')} | {med(floors, '.1f')} | {med(ratios, '.2f')} | "
              f"{med(ios, '.1f')} | {med(full, '.2f')} | {med(floor_io, '.2f')} | "
              f"{med(rss, '.0f')} | {med(imports, '.1f')} | {min(secs) / min(floors):.2f} |")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", type=Path, default=ROOT)
    ap.add_argument("--ks", type=int, nargs="+", default=[2, 5])
    ap.add_argument("--repeat", type=int, default=1, help="runs per merge; the table shows the fastest")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--gram-examples", type=int, default=512)
    ap.add_argument("--one", nargs=2, metavar=("VARIANT", "K"))
    ap.add_argument("--job", choices=["setup", "errors", "gram", "floor", "iofloor", "ratio"])
    ap.add_argument("--suffix", default="", help="iofloor: the statistics folders' suffix (-f32: float32 Grams)")
    ap.add_argument("--rounds", type=int, default=5, help="--job ratio: rounds")
    args = ap.parse_args()
    # Every heavy step runs in its own process: Linux keeps ru_maxrss across fork + exec, so a parent that had
    # built the models would inflate every child's peak RSS.
    if args.one:
        print(json.dumps(one(args.root, args.one[0], int(args.one[1]))))
        return
    if args.job == "setup":
        setup(args.root, max(args.ks))
        setup_f32(args.root, max(args.ks))
        return
    if args.job == "errors":
        print(
            json.dumps({"merge": {k: merge_errors(args.root, k) for k in args.ks}, "layer": layer_errors(args.root, 5)})
        )
        return
    if args.job == "gram":
        print(json.dumps(gram_throughput(args.gram_examples)))
        return
    if args.job == "floor":
        print(json.dumps({k: arithmetic_floor(k) for k in args.ks}))
        return
    if args.job == "iofloor":
        print(json.dumps({k: io_floor(args.root, k, args.suffix) for k in args.ks}))
        return

    def child(*extra: str) -> str:
        cmd = [sys.executable, __file__, "--root", str(args.root), "--ks", *map(str, args.ks), *extra]
        lines = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()
        return lines[-1] if lines else ""

    args.root.mkdir(parents=True, exist_ok=True)
    if args.job == "ratio":
        ratio_table(args, child)
        return
    t = time.perf_counter()
    child("--job", "setup")
    print(f"setup (cached after the first run): {time.perf_counter() - t:.1f} s", flush=True)
    for f in sorted(args.root.glob("[ms]*/*.safetensors")):  # warm the page cache (cold disk reads ~300 MB/s here)
        with open(f, "rb") as fh:
            while fh.read(1 << 26):
                pass
    rows = []
    for k in args.ks:
        for variant in args.variants:
            runs = [json.loads(child("--one", variant, str(k))) for _ in range(args.repeat)]
            rows.append(min(runs, key=lambda r: r["seconds"]))
            print(rows[-1], flush=True)
    errs = json.loads(child("--job", "errors"))
    gt = json.loads(child("--job", "gram", "--gram-examples", str(args.gram_examples)))
    print("\n| merge | K | wall s | CPU s | peak RSS (MiB) | max rel. error vs float64 |\n|---|---|---|---|---|---|")
    for r in rows:
        e = errs["merge"].get(str(r["k"]), {}).get(r["variant"])
        err = "reference" if r["variant"] == "regmean float64" else ("-" if e is None else f"{e:.1e}")
        print(f"| {r['variant']} | {r['k']} | {r['seconds']:.1f} | {r['cpu']:.1f} | {r['peak_rss_mib']:.0f} | {err} |")
    print("\nOne layer, K=5, float32 solve vs float64 (max |diff| / max |W|); (products used):")
    for case, row in errs["layer"].items():
        print(f"  {case}: " + ", ".join(f"{m} {e:.1e}" for m, e in row.items()))
    for dtype, r in gt.items():
        print(
            f"\nGram collection ({dtype} products, float64 accumulators), MiniLM, dair_emotion "
            f"{args.gram_examples} examples: {r['tokens']} tokens in {r['seconds']:.1f} s = "
            f"{r['tokens_per_s']:.0f} tokens/s"
        )
    floors = json.loads(child("--job", "floor"))
    print("\nArithmetic floor of exact RegMean (delta form, float32; compute only, no I/O):")
    print("| K | TFLOP | products s | solves s | Cholesky s | floor s | all flops at GEMM peak s |")
    print("|---|---|---|---|---|---|---|")
    for k, f in floors.items():
        s_ = f["seconds"]
        print(f"| {k} | {f['tflop']:.2f} | {s_['products']:.1f} | {s_['solves']:.1f} | {s_['cholesky']:.1f} | "
              f"{f['floor_s']:.1f} | {f['gemm_bound_s']:.1f} ({f['gemm_gflops']:.0f} GFLOP/s) |")  # fmt: skip
    print("\nTimings on a 2-core CPU shared with other jobs: pessimistic (CPU s counts this process only).")


if __name__ == "__main__":
    main()
