"""Merge speed and memory: RegMean / Fisher over K roberta-base-shaped models, Gram throughput on MiniLM.

    python bench/merge_speed.py [--root /tmp/symfuse-merge-bench] [--ks 2 5] [--gram-examples 512]

Builds (once, cached under --root) K random roberta-base-shaped checkpoints (12 x 768, d_ffn 3072, vocab
50265, 2-label head) with synthetic Gram (float64) and Fisher (float32) statistics of the real file format,
then times each merge in a FRESH subprocess (peak RSS = that process's ru_maxrss, imports included) and
prints a table. RegMean runs in float64 and float32; the float32 error is measured against float64.
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

ROOT = Path("/tmp/symfuse-merge-bench")


def _config():
    import transformers as T

    return T.RobertaConfig(
        vocab_size=50265,
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        intermediate_size=3072,
        max_position_embeddings=514,
        type_vocab_size=1,
        pad_token_id=1,
        num_labels=2,
    )


def _spd(n, g):
    import torch

    b = torch.randn(n, 8, generator=g, dtype=torch.float64)
    return torch.diag(torch.rand(n, generator=g, dtype=torch.float64) + 0.5) + b @ b.T / 8


def setup(root: Path, k: int) -> None:
    import torch
    import transformers as T
    from safetensors.torch import load_file, save_file

    from symfuse.stats import linear_modules, save_stats

    if (root / f"ready-{k}").exists():
        return
    torch.manual_seed(0)
    model = T.RobertaForSequenceClassification(_config())
    lins = {n: m.in_features for n, m in linear_modules(model).items()}
    src = root / "m0"
    if not src.exists():
        model.save_pretrained(src)
    base_sd = load_file(str(src / "model.safetensors"))
    for i in range(k):
        folder = root / f"m{i}"
        g = torch.Generator().manual_seed(100 + i)
        if not folder.exists():
            folder.mkdir(parents=True)
            shutil.copy(src / "config.json", folder / "config.json")
            sd = {
                n: (t + 0.01 * torch.randn(t.shape, generator=g) if t.is_floating_point() else t)
                for n, t in base_sd.items()
            }
            save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
        st = root / f"s{i}"
        if not (st / "gram.safetensors").exists():
            grams, shared = {}, {}
            for name, n_in in lins.items():
                parent = name.rsplit(".", 1)[0]  # q / k / v share their input, as in a real model
                key = parent if name.endswith(("query", "key", "value")) else name
                if key not in shared:
                    shared[key] = _spd(n_in, g)
                grams[name] = shared[key].clone()
            save_stats(grams, st / "gram.safetensors", {"kind": "gram", "conv1d": [], "dataset": f"d{i}"})
        if not (st / "fisher.safetensors").exists():
            fisher = {n: torch.rand(p.shape, generator=g) for n, p in model.named_parameters()}
            save_stats(fisher, st / "fisher.safetensors", {"kind": "fisher", "dataset": f"d{i}"})
    (root / f"ready-{k}").touch()


def one(root: Path, strategy: str, k: int, dtype: str) -> dict:
    from symfuse.merge import merge_checkpoints

    params = {"dtype": dtype} if strategy == "regmean" else {}
    out = root / f"out-{strategy}-{k}-{dtype}"
    t = time.perf_counter()
    merge_checkpoints(
        strategy,
        [root / f"m{i}" for i in range(k)],
        out,
        stats=[root / f"s{i}" for i in range(k)],
        overwrite=True,
        **params,
    )
    seconds = time.perf_counter() - t
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB (Linux: KiB)
    return {"strategy": strategy, "k": k, "dtype": dtype, "seconds": seconds, "peak_rss_mib": rss}


def float32_error(root: Path, k: int) -> float:
    from symfuse.merge import StreamingReader

    a = StreamingReader(root / f"out-regmean-{k}-float64")
    b = StreamingReader(root / f"out-regmean-{k}-float32")
    worst = 0.0
    for n in a.names():
        t = a.get(n)
        if n.endswith(".weight") and t.dim() == 2 and "embeddings" not in n:
            worst = max(worst, float((b.get(n).double() - t.double()).abs().max() / t.double().abs().max()))
    return worst


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", type=Path, default=ROOT)
    ap.add_argument("--ks", type=int, nargs="+", default=[2, 5])
    ap.add_argument("--gram-examples", type=int, default=512)
    ap.add_argument("--one", nargs=3, metavar=("STRATEGY", "K", "DTYPE"))
    ap.add_argument("--job", choices=["setup", "error", "gram"])
    args = ap.parse_args()
    # Every heavy step runs in its own process: Linux keeps ru_maxrss across fork + exec, so a parent that had
    # built the models would inflate every child's peak RSS.
    if args.one:
        print(json.dumps(one(args.root, args.one[0], int(args.one[1]), args.one[2])))
        return
    if args.job == "setup":
        setup(args.root, max(args.ks))
        return
    if args.job == "error":
        print(json.dumps({k: float32_error(args.root, k) for k in args.ks}))
        return
    if args.job == "gram":
        print(json.dumps(gram_throughput(args.gram_examples)))
        return

    def child(*extra: str) -> str:
        cmd = [sys.executable, __file__, "--root", str(args.root), "--ks", *map(str, args.ks), *extra]
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]

    args.root.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    subprocess.run(
        [sys.executable, __file__, "--root", str(args.root), "--ks", *map(str, args.ks), "--job", "setup"],
        check=True,
        capture_output=True,
    )
    print(f"setup (cached after the first run): {time.perf_counter() - t:.1f} s", flush=True)
    rows = []
    for k in args.ks:
        for strategy, dtype in (("regmean", "float64"), ("regmean", "float32"), ("fisher", "-")):
            rows.append(json.loads(child("--one", strategy, str(k), dtype)))
            print(rows[-1], flush=True)
    errs = {int(k): v for k, v in json.loads(child("--job", "error")).items()}
    gt = json.loads(child("--job", "gram", "--gram-examples", str(args.gram_examples)))
    print("\n| merge | K | dtype | seconds | peak RSS (MiB) |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['strategy']} | {r['k']} | {r['dtype']} | {r['seconds']:.1f} | {r['peak_rss_mib']:.0f} |")
    for k, e in errs.items():
        print(f"\nRegMean float32 vs float64, K={k}: max relative error {e:.2e} (max |diff| / max |W| per weight)")
    for dtype, r in gt.items():
        print(
            f"\nGram collection ({dtype} products, float64 accumulators), MiniLM, dair_emotion "
            f"{args.gram_examples} examples: {r['tokens']} tokens in {r['seconds']:.1f} s = "
            f"{r['tokens_per_s']:.0f} tokens/s"
        )
    print("\nTimings on a 2-core CPU shared with other jobs: pessimistic.")


if __name__ == "__main__":
    main()
