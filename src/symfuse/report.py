"""The run report: metrics per strategy x {plain, matched}, matching distances, timings (pandas + matplotlib).

Pure functions over plain records (no store, no Prefect): the pipeline's ``report`` task gathers the records from
the store and calls :func:`build_report`, which writes ``report.md``, ``metrics.csv`` and PNG plots into a folder.

Records:

* evaluation: ``{"model": "simple-matched", "strategy": "simple", "variant": "matched", "dataset": "isear",
  "domain": "in" | "out", "metrics": {"accuracy": 0.61, "macro_f1": 0.55, ...}}``; a fine-tuned (unmerged) model has
  ``strategy = "individual"`` and ``variant = <its dataset>``.
* distance: ``{"model": "isear", "module": "L03.attn", "before": 12.3, "after": 8.1}`` (source to anchor, per module).
* timing: ``{"stage": "finetune", "name": "finetune-isear", "seconds": 41.2}``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from symfuse.report_findings import findings_markdown, inspection_markdown, paths_markdown, to_markdown

log = logging.getLogger(__name__)

# The first of these that an evaluation reports is the headline metric of the table.
PRIMARY_METRICS = ("accuracy", "macro_f1", "f1", "micro_f1", "pearson", "spearman", "neg_loss")
VARIANT_ORDER = ("plain", "matched", "greedy")


@dataclass(frozen=True)
class Report:
    """What :func:`build_report` wrote.

    Attributes:
        markdown: The report text (also in ``report.md``).
        table: Headline metric per (strategy, variant) row and evaluation dataset column, plus means.
        files: File name -> path of every file written (``report.md``, ``metrics.csv``, ``*.png``).
        metric: The headline metric's name.
    """

    markdown: str
    table: pd.DataFrame
    files: dict[str, Path]
    metric: str


def metrics_frame(evaluations: Iterable[Mapping[str, Any]]) -> pd.DataFrame:
    """Long table of every metric: one row per (model, dataset, metric).

    Args:
        evaluations: Evaluation records (see the module docstring).

    Returns:
        Columns ``model strategy variant dataset domain metric value``.

    Raises:
        ValueError: if a record lacks a field.
    """
    rows = []
    for ev in evaluations:
        missing = {"model", "strategy", "variant", "dataset", "domain", "metrics"} - set(ev)
        if missing:
            raise ValueError(f"evaluation record {dict(ev)!r} lacks {sorted(missing)}")
        for name, value in ev["metrics"].items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue  # counts, label lists, ... are not metrics
            rows.append(
                {k: ev[k] for k in ("model", "strategy", "variant", "dataset", "domain")}
                | {
                    "metric": name,
                    "value": float(value),
                }
            )
    return pd.DataFrame(rows, columns=["model", "strategy", "variant", "dataset", "domain", "metric", "value"])


def primary_metric(long: pd.DataFrame, preferred: Sequence[str] = PRIMARY_METRICS) -> str:
    """The headline metric: the first of ``preferred`` reported for every evaluated dataset, else the most common.

    Raises:
        ValueError: if there are no metrics at all.
    """
    if long.empty:
        raise ValueError("no evaluation metrics to report: did every evaluate task fail?")
    per_dataset = long.groupby("dataset")["metric"].apply(set)
    for name in preferred:
        if all(name in names for names in per_dataset):
            return name
    return str(long["metric"].value_counts().index[0])


def metrics_table(long: pd.DataFrame, metric: str) -> pd.DataFrame:
    """Headline metric per (strategy, variant) and evaluation dataset, with in-domain and out-of-domain means.

    Args:
        long: :func:`metrics_frame` output.
        metric: The metric to tabulate.

    Returns:
        Index ``(strategy, variant)``; one column per dataset (in-domain first), then ``in-domain mean`` and
        ``out-of-domain mean`` (when there are such datasets). Merged strategies come after the individual models,
        plain before matched.
    """
    sel = long[long["metric"] == metric]
    table = sel.pivot_table(index=["strategy", "variant"], columns="dataset", values="value", aggfunc="mean")
    domains = sel.drop_duplicates("dataset").set_index("dataset")["domain"]
    in_sets = sorted(d for d in table.columns if domains[d] == "in")
    out_sets = sorted(d for d in table.columns if domains[d] != "in")
    table = table[in_sets + out_sets]
    if in_sets:
        table["in-domain mean"] = table[in_sets].mean(axis=1)
    if out_sets:
        table["out-of-domain mean"] = table[out_sets].mean(axis=1)

    def order(key: tuple[str, str]) -> tuple[int, str, int, str]:
        strategy, variant = key
        rank = VARIANT_ORDER.index(variant) if variant in VARIANT_ORDER else -1
        return (0 if strategy == "individual" else 1, strategy, rank, variant)

    table = table.loc[sorted(table.index, key=order)]
    table.columns.name = None
    return table


def distances_table(distances: Iterable[Mapping[str, Any]]) -> pd.DataFrame:
    """Distance to the anchor before and after matching, summed over modules, per model and module kind.

    Returns:
        Columns ``model kind modules before after reduction`` (``reduction`` = 1 - after / before).
    """
    df = pd.DataFrame(list(distances), columns=["model", "module", "before", "after"])
    if df.empty:
        return pd.DataFrame(columns=["model", "kind", "modules", "before", "after", "reduction"])
    df["kind"] = df["module"].str.split(".").str[-1]
    out = df.groupby(["model", "kind"], as_index=False).agg(
        modules=("module", "count"), before=("before", "sum"), after=("after", "sum")
    )
    out["reduction"] = 1.0 - out["after"] / out["before"].where(out["before"] != 0)
    return out


def timings_table(timings: Iterable[Mapping[str, Any]]) -> pd.DataFrame:
    """Task count, total and longest seconds per pipeline stage, slowest stage first."""
    df = pd.DataFrame(list(timings), columns=["stage", "name", "seconds"])
    if df.empty:
        return pd.DataFrame(columns=["stage", "tasks", "total_s", "max_s"])
    out = df.groupby("stage", as_index=False).agg(
        tasks=("name", "count"), total_s=("seconds", "sum"), max_s=("seconds", "max")
    )
    return out.sort_values("total_s", ascending=False, ignore_index=True)


def _plot_metrics(table: pd.DataFrame, metric: str, file: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = [c for c in table.columns if not c.endswith("mean")]
    labels = [f"{s}\n{v}" for s, v in table.index]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(labels) + 2), 4.0))
    width = 0.8 / max(1, len(cols))
    for i, col in enumerate(cols):
        xs = [j + (i - (len(cols) - 1) / 2) * width for j in range(len(labels))]
        ax.bar(xs, table[col].fillna(0.0).to_numpy(), width=width, label=col)
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} per model and evaluation set")
    ax.legend(fontsize=7, ncols=2)
    fig.tight_layout()
    fig.savefig(file, dpi=110)
    plt.close(fig)
    return file


def _plot_distances(distances: Iterable[Mapping[str, Any]], file: Path) -> Path | None:
    df = pd.DataFrame(list(distances), columns=["model", "module", "before", "after"])
    if df.empty:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    df = df.sort_values(["model", "module"])
    fig, ax = plt.subplots(figsize=(max(6.0, 0.35 * df["module"].nunique() + 3), 4.0))
    for model, part in df.groupby("model"):
        (line,) = ax.plot(part["module"], part["before"], "--", marker="o", label=f"{model} before")
        ax.plot(part["module"], part["after"], "-", marker="o", color=line.get_color(), label=f"{model} after")
    ax.set_ylabel("distance to anchor")
    ax.set_title("weight distance to the anchor, before and after matching")
    ax.tick_params(axis="x", labelrotation=60, labelsize=7)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(file, dpi=110)
    plt.close(fig)
    return file


def selection_markdown(selections: Sequence[Mapping[str, Any]]) -> list[str]:
    """Report lines for greedy selection: per strategy the chosen subset, its score and the path of tries."""
    if not selections:
        return []
    lines = ["## Greedy selection of the models to merge", ""]
    for sel in selections:
        on = ", ".join(sel.get("on") or [])
        lines += [
            f"**{sel['strategy']}**: chosen {' + '.join(sel['chosen'])} (validation score {sel['score']:.4f}, "
            f"mean primary metric on the validation splits of {on}); model `{sel['strategy']}-greedy`.",
            "",
            "| step | tried | validation score | kept |",
            "| --- | --- | --- | --- |",
        ]
        lines += [
            f"| {i} | {' + '.join(step['subset'])} | {step['score']:.4f} | {'yes' if step['kept'] else 'no'} |"
            for i, step in enumerate(sel["path"], 1)
        ]
        lines.append("")
    return lines


def build_report(
    evaluations: Iterable[Mapping[str, Any]],
    distances: Iterable[Mapping[str, Any]],
    timings: Iterable[Mapping[str, Any]],
    out_dir: str | Path,
    title: str = "symfuse run",
    facts: Mapping[str, Any] | None = None,
    selections: Sequence[Mapping[str, Any]] = (),
    inspection: Mapping[str, Any] | None = None,
    paths: Sequence[Mapping[str, Any]] = (),
) -> Report:
    """Write ``report.md``, ``metrics.csv`` (every metric, long form), ``metrics.png`` and ``distances.png``.

    Args:
        evaluations: Evaluation records (module docstring).
        distances: Per-module distance records.
        timings: Per-task timing records.
        out_dir: Folder to write into (created).
        title: Report heading.
        facts: Run facts listed under the heading (run id, base model, datasets, ...).
        selections: Greedy selection records (``strategy``, ``chosen``, ``score``, ``on``, ``path`` of tries).
        inspection: ``symfuse inspect``'s record on the models (its verdict opens the report), or None.
        paths: Loss paths from the anchor to models not fine-tuned from one base, plain and aligned
            (:func:`symfuse.report_findings.paths_markdown`).

    Returns:
        The :class:`Report`.

    Raises:
        ValueError: if there is no evaluation to report.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    evaluations, distances, timings = list(evaluations), list(distances), list(timings)
    long = metrics_frame(evaluations)
    # the metric the evaluations name as their primary (e.g. macro_f1), when every dataset reports it
    declared = [ev["metrics"].get("primary") for ev in evaluations if isinstance(ev["metrics"].get("primary"), str)]
    preferred = tuple(dict.fromkeys([*sorted(set(declared), key=declared.count, reverse=True), *PRIMARY_METRICS]))
    metric = primary_metric(long, preferred)
    table = metrics_table(long, metric)
    dist = distances_table(distances)
    times = timings_table(timings)

    files = {"metrics.csv": out / "metrics.csv"}
    long.sort_values(["strategy", "variant", "dataset", "metric"]).to_csv(files["metrics.csv"], index=False)
    files["metrics.png"] = _plot_metrics(table, metric, out / "metrics.png")
    plot = _plot_distances(distances, out / "distances.png")
    if plot is not None:
        files["distances.png"] = plot

    parts = [f"# {title}", ""]
    parts += [f"- **{k}**: {v}" for k, v in (facts or {}).items()]
    parts += ["", *inspection_markdown(inspection), *paths_markdown(paths)]
    parts += [f"## {metric} per strategy × matching", "", to_markdown(table), ""]
    best = table.drop(index="individual", level=0, errors="ignore")
    score_col = "in-domain mean" if "in-domain mean" in best.columns else None
    if score_col and not best.empty and best[score_col].notna().any():
        s, v = best[score_col].idxmax()
        parts += [f"Best merge ({score_col}): **{s} / {v}** = {best.loc[(s, v), score_col]:.4f}", ""]
    parts += ["![metrics](metrics.png)", ""]
    mcc = long[(long["metric"] == "matthews") & (long["domain"] == "in")]
    if metric != "matthews" and not mcc.empty:  # beside macro-F1: 0 is the majority class, whatever the imbalance
        parts += ["## Matthews' correlation on the in-domain sets (0: no better than one class)", ""]
        parts += [to_markdown(metrics_table(mcc, "matthews")), ""]
    parts += findings_markdown(dist, table, metric)
    parts += selection_markdown(selections)
    if not dist.empty:
        parts += ["## Distance to the anchor before / after matching", "", to_markdown(dist, index=False), ""]
        parts += ["![distances](distances.png)", ""]
    if not times.empty:
        parts += ["## Timings (seconds of task work)", "", to_markdown(times, floatfmt=".1f", index=False), ""]
    parts += ["All metrics (long form): `metrics.csv`.", ""]
    markdown = "\n".join(parts)
    files["report.md"] = out / "report.md"
    files["report.md"].write_text(markdown)
    log.info("report written to %s (%s)", out, ", ".join(files))
    return Report(markdown=markdown, table=table, files=files, metric=metric)
