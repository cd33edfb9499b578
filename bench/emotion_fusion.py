"""RegMean's emotion protocol with MiniLM (issue 15): fine-tune per dataset, merge, evaluate in and out of domain.

MiniLM (``base_model: minilm``) is fine-tuned on each of the four shared emotion sets (dair_emotion, crowdflower,
isear, meld; different label sets, so one merged body with per-dataset heads); the models are merged with simple,
fisher, regmean and regmean++, each on the plain and on the symmetry-matched models; every model is evaluated on
each training set's test split (macro-F1 over that dataset's classes) and on goemotions_ekman (held out; macro-F1
over the classes its head shares with it). Everything runs through the pipeline (``flows.pipeline``), one run per
seed and setting, in a local store (``bench/out/emotion_fusion`` by default).

Settings: per-dataset heads; union heads (``labels: union``, one multi-label head over the union of the label sets,
each class merged over the models that learned it) with the same or different head initialisation. Every run also
selects a subset greedily (``select: greedy``, rows ``<strategy> greedy``) next to the merges of all models
(``--select all``: no greedy rows). ``--head-refit`` adds, per ``--refit-ridges`` value, the same setting with the
merged heads refitted (``head_refit``); it shares the setting's fine-tunes and statistics (one run id), and its
merges replace the setting's in the store, so re-running reuses less.

    python bench/emotion_fusion.py --quick                         # 1 seed, tiny caps (2 CPU cores: 32 ex. took 6 min)
    python bench/emotion_fusion.py --train-examples 2000 --epochs 2 --seeds 13,14,15

Writes ``bench/results/emotion_fusion.md`` (``--results``) and ``.json`` next to it (every number, per seed). This
is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

from symfuse.config import RunConfig  # noqa: E402  (after the path set-up: runs from any folder)

log = logging.getLogger("emotion_fusion")

DATASETS = ("dair_emotion", "crowdflower", "isear", "meld")
OOD = "goemotions_ekman"
STRATEGIES = ("simple", "fisher", "regmean", "regmean++")
DEFAULT_LR = 1e-4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="1 seed, 200 training examples, 1 epoch, 100 test examples")
    p.add_argument("--train-examples", type=int, default=2000, help="training examples per dataset")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--seeds", default="13,14,15", help="comma-separated fine-tuning seeds")
    p.add_argument("--eval-examples", type=int, default=500, help="test examples per evaluation set (0: all)")
    p.add_argument("--stats-examples", type=int, default=256, help="examples per model for Grams / Fishers")
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--lr", type=float, default=DEFAULT_LR)
    p.add_argument("--head-lr-scale", type=float, default=1.0, help="the new head's learning rate = lr x this")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--no-extra-settings", action="store_true", help="only the default setting (no labels/...)")
    p.add_argument(
        "--head-refit",
        action="store_true",
        help="also per-dataset heads with head_refit on (same fine-tunes; merges re-made, then put back)",
    )
    p.add_argument("--refit-ridges", default="0.1", help="comma-separated head refit ridges (one setting each)")
    p.add_argument(
        "--ood-heads",
        default="vote",
        help="comma-separated rules for a merged model's heads out of domain (vote, closest, reliable): the first is "
        "the default setting's, each other adds a per-dataset-heads setting (same fine-tunes and merges)",
    )
    p.add_argument("--select", choices=["all", "greedy"], default="greedy", help="greedy adds <strategy>-greedy rows")
    p.add_argument("--store", default=str(ROOT / "bench" / "out" / "emotion_fusion"))
    p.add_argument("--results", default=str(ROOT / "bench" / "results" / "emotion_fusion.md"))
    args = p.parse_args(argv)
    if args.quick:
        args.train_examples, args.epochs, args.seeds, args.eval_examples, args.stats_examples = 200, 1, "13", 100, 64
    args.seed_list = [int(s) for s in args.seeds.split(",") if s.strip()]
    args.strategy_list = [s for s in args.strategies.split(",") if s.strip()]
    args.ood_rules = [s.strip() for s in args.ood_heads.split(",") if s.strip()] or ["vote"]
    return args


def settings(
    skip_extra: bool,
    head_refit: bool = False,
    select: str = "greedy",
    ridges: tuple[float, ...] = (0.1,),
    ood_rules: tuple[str, ...] = ("vote",),
) -> tuple[list[tuple[str, dict[str, Any]]], list[str]]:
    """``[(label, RunConfig overrides)]`` and notes on the settings not run.

    Every run selects greedily too (``select: greedy`` keeps every all-model merge and adds ``<strategy>-greedy``),
    so "all models vs greedy subset" are rows of one run. Head initialisation only matters where heads are merged,
    i.e. with union heads (per-dataset heads are kept per model, never merged).
    """
    rule, *others = ood_rules
    first = {"select": select} | ({"ood_heads": rule} if rule != "vote" else {})
    out: list[tuple[str, dict[str, Any]]] = [("per-dataset heads" + (f", OOD {rule}" if rule != "vote" else ""), first)]
    for r in others:  # same run id: only the out-of-domain evaluations are re-made
        out.append((f"per-dataset heads, OOD {r}", {"select": select, "ood_heads": r}))
    for r in ridges if head_refit else ():  # same run id (same fine-tunes and statistics); merges replaced
        out.append((f"per-dataset heads, head refit (ridge {r:g})",
                    {"select": select, "head_refit": {"enabled": True, "ridge": r}}))  # fmt: skip
    if skip_extra:
        return out, ["union heads and head initialisation: skipped (--no-extra-settings)"]
    out += [
        ("union heads, same init", {"labels": "union", "select": select}),
        ("union heads, different init", {"labels": "union", "head_init": "different", "select": select}),
        # the subset chosen on held-out data's VALIDATION split (the "user-given OOD validation set"); the
        # OOD column reads its TEST split. Same fine-tunes and merges as "union heads, same init" (one run id).
        (f"union heads, greedy on {OOD} validation", {"labels": "union", "select": "greedy", "select_on": OOD}),
    ]
    for r in ridges if head_refit else ():
        out.append((f"union heads, head refit (ridge {r:g})",
                    {"labels": "union", "select": select, "head_refit": {"enabled": True, "ridge": r}}))  # fmt: skip
    return out, []


# Overrides that change only what is merged or how it is selected: runs that differ only in these share one run id
# (their fine-tunes and statistics).
RUN_SHARING = ("select", "select_on", "head_refit", "ood_heads")


def build_config(args: argparse.Namespace, seed: int, label: str, overrides: dict[str, Any]) -> RunConfig:
    """The run of one seed and setting."""
    tag = "-".join(f"{k}-{v}" for k, v in sorted(overrides.items()) if k not in RUN_SHARING) or "default"
    overrides = dict(overrides)
    ood_heads = overrides.pop("ood_heads", "vote")
    cap = args.eval_examples or None  # 0: every test example
    data = {
        "run_id": f"emo-s{seed}-{tag}-n{args.train_examples}-e{args.epochs}"
        + (f"-h{args.head_lr_scale:g}" if args.head_lr_scale != 1 else "")
        + (f"-lr{args.lr:g}" if args.lr != DEFAULT_LR else ""),  # another lr never reuses stored fine-tunes
        "base_model": "minilm",
        "datasets": [
            {"name": n, "max_train_examples": args.train_examples, "max_eval_examples": cap} for n in DATASETS
        ],
        "finetune": {
            "epochs": args.epochs,
            "lr": args.lr,
            "head_lr_scale": args.head_lr_scale,
            "batch_size": 16,
            "max_length": args.max_length,
            "seed": seed,
        },
        "stats": {"kinds": ["gram", "fisher"], "max_examples": args.stats_examples, "batch_size": 16},
        "strategies": args.strategy_list,
        "evaluation": {"in_domain": True, "out_of_domain": [OOD], "max_examples": cap, "ood_heads": ood_heads},
        "device": "auto",
        "store_root": args.store,
        **overrides,
    }
    return RunConfig.model_validate(data)


def _seconds(store: Any, uri: str) -> float:
    return float(store.manifest(uri).get("meta", {}).get("seconds") or 0.0)


def rows_of_run(config: RunConfig, result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per model of a finished run: in-domain macro-F1 (mean over the training sets), OOD macro-F1, time."""
    from symfuse.store import ArtifactStore, layout

    store = ArtifactStore(config.resolved_store_root())
    records = [store.get_json(u) for u in result["evaluations"]]
    by_model: dict[str, dict[str, float]] = {}
    for r in records:
        by_model.setdefault(r["model"], {})[r["dataset"]] = float(r["metrics"].get("macro_f1", float("nan")))
    names = config.dataset_names
    stats_s = {}
    for n in names:
        for kind in config.stats.kinds:
            key = layout.stats_key(config.run_id, n, n, kind)
            if store.exists(key):
                stats_s[kind] = stats_s.get(kind, 0.0) + _seconds(store, store.uri(key))
    finetune_s = {n: _seconds(store, store.uri(layout.model_key(config.run_id, n))) for n in names}
    reads = {"fisher": ["fisher"], "regmean": ["gram"]}
    rows = []
    for model, scores in by_model.items():
        if model in names:
            row = {"model": "individual", "variant": model, "in_domain": scores[model], "ood": scores.get(OOD),
                   "seconds": finetune_s[model], "own": True}  # fmt: skip
        else:
            strategy, _, variant = model.rpartition("-")
            seconds = _seconds(store, result["merged"][model]) + sum(stats_s.get(k, 0) for k in reads.get(strategy, []))
            row = {"model": strategy, "variant": variant, "in_domain": statistics.fmean(scores[n] for n in names),
                   "ood": scores.get(OOD), "seconds": seconds, "own": False}  # fmt: skip
        row["per_dataset"] = {n: scores.get(n) for n in names}
        rows.append(row)
    return rows


def _ms(values: list[float]) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "—"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.fmean(values):.3f} ± {statistics.stdev(values):.3f}"


def summarise(runs: list[dict[str, Any]]) -> tuple[list[str], dict[str, Any]]:
    """Markdown table lines per setting, and the issue's targets checked on the seed means."""
    lines, verdicts = [], {}
    for label in dict.fromkeys(r["setting"] for r in runs):
        mine = [r for r in runs if r["setting"] == label]
        lines += [f"### Setting `{label}`", "",
                  "| model | variant | in-domain macro-F1 | OOD macro-F1 (shared classes) | time (s) |",
                  "|---|---|---|---|---|"]  # fmt: skip
        keys = list(dict.fromkeys((r["model"], r["variant"]) for run in mine for r in run["rows"]))
        means: dict[tuple[str, str], tuple[float, float | None]] = {}
        for key in keys:
            got = [r for run in mine for r in run["rows"] if (r["model"], r["variant"]) == key]
            ind, ood = [r["in_domain"] for r in got], [r["ood"] for r in got if r["ood"] is not None]
            means[key] = (statistics.fmean(ind), statistics.fmean(ood) if ood else None)
            lines.append(f"| {key[0]} | {key[1]} | {_ms(ind)} | {_ms(ood)} | {_ms([r['seconds'] for r in got])} |")
        lines.append("")
        indiv = {k: v for k, v in means.items() if k[0] == "individual"}
        merged = {k: v for k, v in means.items() if k[0] != "individual"}
        if indiv and merged:
            own_mean = statistics.fmean(v[0] for v in indiv.values())
            best_ood = max((v[1] for v in indiv.values() if v[1] is not None), default=float("nan"))
            best_key = max(merged, key=lambda k: (merged[k][1] or 0) + merged[k][0])
            best = merged[best_key]
            plain = {k[0]: v[0] for k, v in merged.items() if k[1] == "plain"}
            verdicts[label] = {
                "individual_own_domain_mean": own_mean,
                "best_individual_ood": best_ood,
                "best_merge": "-".join(best_key),
                "best_merge_in_domain": best[0],
                "best_merge_ood": best[1],
                "ood_target_met": best[1] is not None and best[1] >= best_ood,
                "in_domain_target_met": best[0] >= 0.9 * own_mean,
                "regmean>=fisher>=simple (plain)": (
                    plain.get("regmean", -1) >= plain.get("fisher", -1) >= plain.get("simple", -1)
                    if {"regmean", "fisher", "simple"} <= set(plain)
                    else None
                ),
                "regmean++>=regmean (plain)": (
                    plain["regmean++"] >= plain["regmean"] if {"regmean", "regmean++"} <= set(plain) else None
                ),
            }
    return lines, verdicts


def write_results(args: argparse.Namespace, runs: list[dict[str, Any]], notes: list[str], wall: float) -> None:
    """``--results`` (markdown) and the same stem ``.json`` (every row of every run)."""
    lines, verdicts = summarise(runs)
    cmd = "python bench/emotion_fusion.py " + " ".join(sys.argv[1:])
    text = [
        "# Emotion fusion benchmark (RegMean protocol, MiniLM)",
        "",
        f"Command: `{cmd}` (wall time {wall / 60:.1f} min, device: {runs[0]['device'] if runs else '?'}).",
        "",
        f"Sizes: {args.train_examples} training examples per dataset, {args.epochs} epoch(s), seeds "
        f"{args.seed_list}, {args.eval_examples or 'all'} test examples per evaluation set, statistics on "
        f"{args.stats_examples} examples per model, max_length {args.max_length}, lr {args.lr} (head: x "
        f"{args.head_lr_scale}).",
        "Datasets: " + ", ".join(DATASETS) + f"; out of domain: {OOD}. In-domain: mean over the four test sets of",
        "macro-F1 over each dataset's own classes (merged models: each dataset with its own head). OOD: macro-F1 on",
        f"{OOD} over the six Ekman classes it shares with the training sets (neutral excluded), for every model",
        "(a head lacking one of them scores F1 0 on it); a merged model's",
        "per-dataset heads vote (mean softmax probability per class over the heads that have it; settings marked",
        "'OOD reliable': the head with the best score on its own validation split over those classes answers",
        "alone), a union head is read directly. Time: fine-tuning (individual), merge (+ the statistics the",
        "strategy reads, summed over models; regmean++ collects its Grams inside the merge).",
        "Table cells: mean ± standard deviation over seeds.",
        "",
        *lines,
        "## Targets (on the seed means)",
        "",
        "```json",
        json.dumps(verdicts, indent=2),
        "```",
        "",
    ]
    if notes:
        text += ["## Settings not run", "", *[f"- {n}" for n in notes], ""]
    out = Path(args.results)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"args": vars(args), "runs": runs, "verdicts": verdicts}, indent=2))
    out.write_text("\n".join(text))
    print("\n".join(text))


def main(argv: list[str] | None = None) -> int:
    """Run every seed x setting through the pipeline and write the results."""
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # no telemetry: registries-only network
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args = parse_args(argv)
    ridges = tuple(float(r) for r in args.refit_ridges.split(",") if r.strip())
    todo, notes = settings(args.no_extra_settings, args.head_refit, args.select, ridges, tuple(args.ood_rules))
    from flows.pipeline import fusion_pipeline
    from symfuse.logs import quiet_third_party

    quiet_third_party()
    start, runs = time.perf_counter(), []
    for seed in args.seed_list:
        for label, overrides in todo:
            config = build_config(args, seed, label, overrides)
            t0 = time.perf_counter()
            result = fusion_pipeline(config)
            runs.append({"seed": seed, "setting": label, "run_id": config.run_id, "device": config.resolved_device(),
                         "seconds": time.perf_counter() - t0, "rows": rows_of_run(config, result)})  # fmt: skip
            log.info("seed %d, setting %s: %.0f s", seed, label, runs[-1]["seconds"])
    write_results(args, runs, notes, time.perf_counter() - start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
