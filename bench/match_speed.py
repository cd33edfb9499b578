"""Matching speed and peak memory: prints a table (not a timed test).

Cases (each prepared, then measured in its own subprocess so peak RSS is the matching process's own):
  minilm               real all-MiniLM-L6-v2 vs a disguised copy (random rotations, scales, FFN permutations, 1 % noise)
  roberta-planted      random roberta-base-shaped model (12 x d768, 12 heads, FFN 3072) vs its disguise + 1 % noise
  roberta-independent  two random roberta-base-shaped models (different seeds)
  llama7b-2 / -4       llama with 7B widths (d 4096, 32 q / 8 kv heads, FFN 11008, vocab 32000), 2 or 4 layers,
                       bf16, sharded (one shard per layer), written streaming; vs its disguise + 1 % noise

Timed region ("match s"): ``match_all_modules`` on two already-open ``CheckpointReader`` s, i.e. reading every
module's tensors (safetensors mmap, page faults included), their finiteness checks and the closed-form solves (the
matching itself). Not timed: Python imports and opening the readers (config.json parse, safetensors index), done
just before. "write s" = streaming the matched checkpoint (with per-module distances), not part of "match s".
"match cpu s" = process CPU time of the timed region (a fairer number than wall time when other jobs share the
cores). Breakdown columns are wall seconds summed over modules (threads overlap, so they can exceed "match s").
"rss gib" = the process's peak RSS over matching AND writing (ru_maxrss, GiB).

Whole command (``--job command``, issue 17): for a case, five rounds of two fresh subprocesses each, (a) the
matching alone (as above) and (b) the whole command run in-process through the console entry point
(:func:`symfuse.cli.main`, as ``symfuse match ...`` runs), after the imports (interpreter start and ``import torch,
transformers, symfuse`` excluded, as in the issue): reading, matching, applying, the per-module checks, writing,
the default streamed output check and publishing. Peak RSS of each = the subprocess's VmHWM (/proc/self/status) at
its end, imports included in both. Prints the median and range of: match s, command s, command - match s, and
both peak RSS.

Usage: python bench/match_speed.py [--cases minilm,roberta-planted,...] [--workdir DIR] [--workers N]
       python bench/match_speed.py --job command [--cases roberta-planted] [--rounds 5] [--verify stream]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = ("minilm", "roberta-planted", "roberta-independent", "llama7b-2", "llama7b-4")
DEFAULT = ("rotation", "scaling", "ffn-permutation")


def _roberta(folder: Path, seed: int) -> Path:
    import torch
    import transformers as T

    if folder.exists():
        return folder
    cfg = T.RobertaConfig(
        vocab_size=1000,
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        intermediate_size=3072,
        max_position_embeddings=130,
    )
    torch.manual_seed(seed)
    T.RobertaModel(cfg).save_pretrained(folder)
    return folder


def _llama(folder: Path, layers: int, seed: int) -> Path:
    """Random 7B-width llama, bf16, one shard per layer, written tensor by tensor (low RSS)."""
    import torch
    import transformers as T
    from safetensors.torch import save_file

    if folder.exists():
        return folder
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    d, f, nq, nkv, dh, vocab = 4096, 11008, 32, 8, 128, 32000
    cfg = T.LlamaConfig(
        hidden_size=d,
        intermediate_size=f,
        num_hidden_layers=layers,
        num_attention_heads=nq,
        num_key_value_heads=nkv,
        vocab_size=vocab,
        max_position_embeddings=4096,
        architectures=["LlamaForCausalLM"],
    )
    cfg.save_pretrained(tmp)
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return (0.02 * torch.randn(*shape, generator=g)).to(torch.bfloat16)

    weight_map: dict[str, str] = {}
    total = 0

    def shard(name: str, tensors: dict[str, torch.Tensor]) -> None:
        nonlocal total
        save_file(tensors, str(tmp / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(t.numel() * t.element_size() for t in tensors.values())

    shard("model-embed.safetensors", {"model.embed_tokens.weight": rnd(vocab, d)})
    for i in range(layers):
        p = f"model.layers.{i}."
        ones = torch.ones(d, dtype=torch.bfloat16)
        shard(
            f"model-layer{i:02d}.safetensors",
            {
                p + "self_attn.q_proj.weight": rnd(nq * dh, d),
                p + "self_attn.k_proj.weight": rnd(nkv * dh, d),
                p + "self_attn.v_proj.weight": rnd(nkv * dh, d),
                p + "self_attn.o_proj.weight": rnd(d, nq * dh),
                p + "mlp.gate_proj.weight": rnd(f, d),
                p + "mlp.up_proj.weight": rnd(f, d),
                p + "mlp.down_proj.weight": rnd(d, f),
                p + "input_layernorm.weight": ones,
                p + "post_attention_layernorm.weight": ones.clone(),
            },
        )
    shard(
        "model-head.safetensors",
        {"model.norm.weight": torch.ones(d, dtype=torch.bfloat16), "lm_head.weight": rnd(vocab, d)},
    )
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index))
    tmp.rename(folder)
    return folder


def prepare(case: str, work: Path) -> tuple[Path, Path]:
    """(source, anchor) folders of a case, created once under ``work``."""
    from symfuse.checkpoint import resolve_checkpoint
    from symfuse.match import disguise_checkpoint

    def disguised(base: Path | str, out: Path) -> Path:
        if not out.exists():
            disguise_checkpoint(base, out, seed=1, noise=0.01, kinds=DEFAULT)
        return out

    if case == "minilm":
        anchor = resolve_checkpoint("minilm")
        return disguised("minilm", work / "minilm-disguised"), anchor
    if case.startswith("roberta"):
        base = _roberta(work / "roberta-a", seed=0)
        if case == "roberta-planted":
            return disguised(base, work / "roberta-a-disguised"), base
        return _roberta(work / "roberta-b", seed=1), base
    layers = int(case.rsplit("-", 1)[1])
    base = _llama(work / f"llama7b-{layers}", layers, seed=0)
    return disguised(base, work / f"llama7b-{layers}-disguised"), base


def run(case: str, work: Path, workers: int | None) -> dict:
    """Match one prepared case in this process; returns timings and peak RSS."""
    from symfuse.checkpoint import CheckpointReader
    from symfuse.match.checkpoints import assemble_matched, match_all_modules

    source, anchor = prepare(case, work)
    out = work / f"{case}-matched"
    shutil.rmtree(out, ignore_errors=True)
    timings: dict[str, float] = {}
    with CheckpointReader(source) as src, CheckpointReader(anchor) as anc:
        c0 = time.process_time()
        t0 = time.perf_counter()
        transforms = match_all_modules(src, anc, DEFAULT, workers, timings)
        t_match = time.perf_counter() - t0
        cpu_match = time.process_time() - c0
    t1 = time.perf_counter()
    report = assemble_matched(source, transforms, out, anchor=anchor, logit_check=False)
    t_write = time.perf_counter() - t1
    shutil.rmtree(out, ignore_errors=True)
    rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2
    return {
        "case": case,
        "match_s": t_match,
        "match_cpu_s": cpu_match,
        "write_s": t_write,
        "rss_gib": rss_gib,
        "rel_after": report["distance_after"] / max(report["distance_before"], 1e-30),
        **{k: timings.get(k, 0.0) for k in ("io", "svd", "scaling", "ffn_sketch", "ffn_cost", "hungarian")},
    }


def _vm_hwm_mib() -> float:
    """Peak resident set of this process (VmHWM), MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_cli(argv: list[str]) -> None:
    """``symfuse ARGV`` in this process through the console entry point (its report swallowed); raises on failure."""
    from symfuse.cli import main

    sys.argv = ["symfuse", *argv]
    with contextlib.redirect_stdout(io.StringIO()):  # the report (the RESULT line is ours)
        try:
            main()
        except SystemExit as exc:
            if exc.code:
                raise


def run_command(case: str, work: Path, what: str, verify: str) -> dict:
    """One measurement in this (fresh) process: ``match`` = matching alone, ``command`` = the whole command
    through the console entry point (``symfuse match ...``: :func:`symfuse.cli.main`)."""
    import torch  # noqa: F401  (imports are not timed)
    import transformers  # noqa: F401

    import symfuse.cli.commands
    import symfuse.cli.match  # noqa: F401
    from symfuse.checkpoint import CheckpointReader
    from symfuse.match.checkpoints import match_all_modules

    source, anchor = prepare(case, work)
    out = work / f"{case}-cmd"
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    if what == "match":
        with CheckpointReader(source) as src, CheckpointReader(anchor) as anc:
            match_all_modules(src, anc, DEFAULT)
    else:
        run_cli(["match", str(source), str(anchor), "--out", str(out), "--verify", verify])
    seconds = time.perf_counter() - t0
    shutil.rmtree(out, ignore_errors=True)
    return {"seconds": seconds, "rss_mib": _vm_hwm_mib()}


def command_table(cases: list[str], work: Path, rounds: int, verify: str) -> None:
    """Median (range) over ``rounds`` of the matching alone vs the whole command, each in a fresh process."""
    import statistics

    def med(xs: list[float]) -> str:
        return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"

    print("| case | match s | command s | command - match s | match peak RSS MiB | command peak RSS MiB |")
    print("|---|---|---|---|---|---|")
    whats = ("match", "command")
    for case in cases:
        subprocess.run([sys.executable, __file__, "--prepare", case, "--workdir", str(work)], check=True)
        rows: dict[str, list[dict]] = {w: [] for w in whats}
        for _ in range(rounds):
            for what in whats:
                cmd = [sys.executable, __file__, "--one-command", case, what, "--workdir", str(work)]
                proc = subprocess.run([*cmd, "--verify", verify], check=True, capture_output=True, text=True)
                line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
                rows[what].append(json.loads(line[len("RESULT ") :]))
        m = [r["seconds"] for r in rows["match"]]
        c = [r["seconds"] for r in rows["command"]]
        extra = [ci - mi for ci, mi in zip(c, m, strict=True)]
        rss = {w: [r["rss_mib"] for r in rows[w]] for w in whats}
        print(
            f"| {case} | {med(m)} | {med(c)} | {med(extra)} | {med(rss['match'])} | {med(rss['command'])} |",
            flush=True,
        )


def main() -> None:
    """Prepare and run the cases, each in a subprocess, and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--run", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--prepare", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--one-command", nargs=2, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--job", choices=["cases", "command"], default="cases")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--verify", default="stream", choices=["stream", "full", "none"])
    args = ap.parse_args()
    if args.one_command:
        print("RESULT " + json.dumps(run_command(args.one_command[0], args.workdir, args.one_command[1], args.verify)))
        return
    if args.prepare:
        prepare(args.prepare, args.workdir)
        return
    if args.run:
        print("RESULT " + json.dumps(run(args.run, args.workdir, args.workers)))
        return
    work = args.workdir or Path(tempfile.mkdtemp(prefix="symfuse-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.job == "command":
        cases = args.cases.split(",") if args.cases != ",".join(CASES) else ["roberta-planted"]
        command_table(cases, work, args.rounds, args.verify)
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
        return
    rows = []
    extra = ["--workers", str(args.workers)] if args.workers else []
    for case in args.cases.split(","):
        subprocess.run([sys.executable, __file__, "--prepare", case, "--workdir", str(work)], check=True)
        proc = subprocess.run(
            [sys.executable, __file__, "--run", case, "--workdir", str(work), *extra],
            check=True,
            capture_output=True,
            text=True,
        )
        line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
        rows.append(json.loads(line[len("RESULT ") :]))
        print(f"done {case}", file=sys.stderr)
    cols = ["case", "match_s", "match_cpu_s", "io", "svd", "scaling", "ffn_sketch", "ffn_cost", "hungarian"]
    cols += ["write_s", "rss_gib", "rel_after"]
    print(" | ".join(f"{c:>19}" if c == "case" else f"{c:>11}" for c in cols))
    for r in rows:
        cells = [f"{r['case']:>19}"]
        for c in cols[1:]:
            v = r[c]
            cells.append(f"{v:11.2e}" if c == "rel_after" else f"{v:11.3f}")
        print(" | ".join(cells))
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
