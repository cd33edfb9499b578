"""What the run's numbers mean: did matching move anything, matched minus plain, merges against the individual models.

Pure functions over the tables of :mod:`symfuse.report` (no files, no store); :func:`findings_markdown` renders
them as report sections.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

NOOP_THRESHOLD = 0.01  # matching that moved every distance by less than this fraction changed nothing
IN_MEAN, OUT_MEAN = "in-domain mean", "out-of-domain mean"
NOOP_WHY = (
    "the models share one pre-trained base: fine-tuning moves weights too little for symmetries to realign; "
    "matched merges equal plain merges"
)


@dataclass(frozen=True)
class MatchingEffect:
    """How much matching moved the distance to the anchor.

    Attributes:
        largest_move: The largest ``|1 - after / before|`` over (model, module kind), a fraction.
        where: ``"model / kind"`` of that largest move.
        per_kind: Module kind -> ``1 - sum(after) / sum(before)`` over every model (positive: closer).
        noop: Every move is below :data:`NOOP_THRESHOLD`.
    """

    largest_move: float
    where: str
    per_kind: dict[str, float]
    noop: bool


def matching_effect(dist: pd.DataFrame, threshold: float = NOOP_THRESHOLD) -> MatchingEffect | None:
    """Summarise :func:`symfuse.report.distances_table` output; ``None`` when there are no (non-zero) distances.

    Args:
        dist: Columns ``model kind before after`` (sums over modules).
        threshold: Moves below this fraction count as no move.
    """
    dist = dist[dist["before"] > 0] if not dist.empty else dist
    if dist.empty:
        return None
    moves = (1.0 - dist["after"] / dist["before"]).abs()
    top = int(moves.to_numpy().argmax())
    sums = dist.groupby("kind")[["before", "after"]].sum()
    per_kind = {str(k): float(1.0 - r["after"] / r["before"]) for k, r in sums.iterrows()}
    largest = float(moves.iloc[top])
    where = f"{dist['model'].iloc[top]} / {dist['kind'].iloc[top]}"
    return MatchingEffect(largest_move=largest, where=where, per_kind=per_kind, noop=largest < threshold)


def matched_minus_plain(table: pd.DataFrame) -> pd.DataFrame:
    """Matched minus plain headline metric per strategy (in-domain mean and out-of-domain mean).

    Args:
        table: :func:`symfuse.report.metrics_table` output (index ``(strategy, variant)``).

    Returns:
        Index ``strategy`` (strategies with both variants, in table order); columns ``Δ in-domain mean`` and
        ``Δ out-of-domain mean`` where the table has those means. Empty when no strategy has both.
    """
    cols = [c for c in (IN_MEAN, OUT_MEAN) if c in table.columns]
    rows = {}
    for strategy in dict.fromkeys(s for s, _ in table.index):
        if (strategy, "plain") in table.index and (strategy, "matched") in table.index:
            diff = table.loc[(strategy, "matched"), cols] - table.loc[(strategy, "plain"), cols]
            rows[strategy] = {f"Δ {c}": float(diff[c]) for c in cols}
    out = pd.DataFrame.from_dict(rows, orient="index", columns=[f"Δ {c}" for c in cols])
    out.index.name = "strategy"
    return out


@dataclass(frozen=True)
class VersusIndividuals:
    """Merged models against the fine-tuned models they were merged from.

    Attributes:
        own: Dataset -> the individual model's score on its own test set.
        individual_mean: Mean of ``own``.
        best_ood: The best individual out-of-domain mean (``nan`` without OOD sets).
        best_ood_model: Which individual scored ``best_ood``.
        merges: Index ``(strategy, variant)``; columns ``in-domain mean``, ``% of individual mean``,
            ``out-of-domain mean`` (when there are OOD sets), ``beats best individual OOD``.
    """

    own: dict[str, float]
    individual_mean: float
    best_ood: float
    best_ood_model: str
    merges: pd.DataFrame


def versus_individuals(table: pd.DataFrame) -> VersusIndividuals | None:
    """Each merge's in-domain mean as a % of the individual models' own-domain mean, and OOD against the best one.

    Args:
        table: :func:`symfuse.report.metrics_table` output; individual models are rows ``("individual", dataset)``.

    Returns:
        ``None`` when there are no individual models with an own-domain score or no merges.
    """
    own = {}
    for strategy, variant in table.index:
        if (
            strategy == "individual"
            and variant in table.columns
            and not math.isnan(table.loc[(strategy, variant), variant])
        ):
            own[variant] = float(table.loc[(strategy, variant), variant])
    merges = table.drop(index="individual", level=0, errors="ignore")
    if not own or merges.empty or IN_MEAN not in table.columns:
        return None
    mean = sum(own.values()) / len(own)
    out = pd.DataFrame(index=merges.index)
    out[IN_MEAN] = merges[IN_MEAN]
    out["% of individual mean"] = 100.0 * merges[IN_MEAN] / mean if mean else math.nan
    best, best_model = math.nan, ""
    if OUT_MEAN in table.columns:
        individuals = table.loc[["individual"], OUT_MEAN].dropna() if "individual" in table.index else pd.Series()
        if not individuals.empty:
            best_model = str(individuals.idxmax()[1])
            best = float(individuals.max())
        out[OUT_MEAN] = merges[OUT_MEAN]
        out["beats best individual OOD"] = ["**yes**" if v > best else "no" for v in merges[OUT_MEAN]]
    return VersusIndividuals(own=own, individual_mean=mean, best_ood=best, best_ood_model=best_model, merges=out)


def to_markdown(df: pd.DataFrame, floatfmt: str = ".4f", index: bool = True) -> str:
    """A GitHub markdown table of ``df`` (no extra dependency); NaN shows as ``—``."""
    frame = df.reset_index() if index else df

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return "—" if math.isnan(v) else format(v, floatfmt)
        return str(v)

    header = [str(c) for c in frame.columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join(lines)


def findings_markdown(dist: pd.DataFrame, table: pd.DataFrame, metric: str) -> list[str]:
    """Report lines: the matching verdict, matched minus plain, merges against the individual models."""
    parts: list[str] = []
    effect = matching_effect(dist)
    if effect is not None:
        kinds = ", ".join(f"{k} {100 * v:+.1f} %" for k, v in sorted(effect.per_kind.items()))
        moved = f"largest move {100 * effect.largest_move:.2f} % ({effect.where}); closer to the anchor by {kinds}"
        parts += ["## Did matching change anything?", ""]
        if effect.noop:
            parts += [f"**Matching was a no-op**: it moved the distance to the anchor by less than "
                      f"{100 * NOOP_THRESHOLD:.0f} % ({moved}). Why: {NOOP_WHY}.", ""]  # fmt: skip
        else:
            parts += [f"Matching moved the weights: {moved}.", ""]
    delta = matched_minus_plain(table)
    if not delta.empty:
        parts += [f"## Matched minus plain ({metric})", "", to_markdown(delta, floatfmt="+.4f"), ""]
        if bool((delta.abs() < 5e-5).all().all()):
            parts += ["Matched and plain merges agree to 4 decimals for every strategy.", ""]
    vs = versus_individuals(table)
    if vs is not None:
        own = ", ".join(f"{d} {v:.4f}" for d, v in sorted(vs.own.items()))
        parts += [f"## Merges against the individual models ({metric})", ""]
        parts += [f"- Individual models on their own test set: {own}; mean **{vs.individual_mean:.4f}**."]
        if not math.isnan(vs.best_ood):
            parts += [f"- Best individual out of domain: {vs.best_ood_model} **{vs.best_ood:.4f}**."]
        shown = vs.merges.astype(object)
        shown["% of individual mean"] = [f"{v:.1f} %" for v in vs.merges["% of individual mean"]]
        parts += ["", to_markdown(shown), ""]
        winners = [
            f"{s} / {v}" for (s, v), r in vs.merges.iterrows() if r.get("beats best individual OOD") == "**yes**"
        ]
        if "beats best individual OOD" in vs.merges.columns:
            parts += [f"Merges that beat the best individual out of domain: {', '.join(winners) or 'none'}.", ""]
    return parts


def inspection_markdown(record: Mapping[str, Any] | None) -> list[str]:
    """The report's opening section: ``symfuse inspect``'s verdict on the run's models, with its reason and figures.

    Args:
        record: :func:`symfuse.inspect.inspect_models`'s mapping (weights only), or None (nothing to show).
    """
    if not record:
        return []
    parts = ["## Will these models merge? (symfuse inspect, before any merge)", "",
             f"**Verdict: {record['verdict']}** — {record['reason']}", "",
             f"Each model against the anchor **{record['anchor']}** ({record['shapes']}): the relative weight distance "
             "|B-A|/|A| before and after alignment (the best of all per-module kinds together and, for pre-norm "
             "families, residual-orthogonal).", ""]  # fmt: skip
    rows = []
    for pair in record["pairs"]:
        total = pair.get("total") or {}
        after = [v for k, v in (total.get("after") or {}).items() if k in ("all", "residual-orthogonal")]
        rows.append({"model": pair["model"], "verdict": pair["verdict"], "before": total.get("before"),
                     "after alignment": min(after) if after else None})  # fmt: skip
    parts += [to_markdown(pd.DataFrame(rows), floatfmt=".4g", index=False), ""]
    return parts


def paths_markdown(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """Where alignment matters: the loss along the straight path from the anchor to each model, plain and aligned.

    Args:
        records: ``loss_paths`` records (:func:`symfuse.inspect.paths.path_figures` plus ``model``; or ``skipped``
            with its reason), one per model not fine-tuned from the anchor's base. Empty: no section.
    """
    if not records:
        return []
    parts = ["## Where alignment matters: the loss along the straight path from the anchor", "",
             "These models are not fine-tunes of one base (verdicts above). The loss of (1-λ)·anchor + λ·model on each "
             "model's validation split, with the model as trained and aligned onto the anchor (the same function); "
             "the barrier is the largest excess over the straight line between the end losses.", ""]  # fmt: skip
    rows = []
    for r in records:
        if "skipped" in r:
            rows.append({"model": r["model"], "end loss": None, "barrier plain": None, "barrier aligned": None,
                         "note": r["skipped"]})  # fmt: skip
            continue
        plain, aligned = r["plain"]["barrier"], r["aligned"]["barrier"]
        cut = f"{1 - aligned / plain:.0%} lower" if plain > 0 else ""
        note = f"{cut} ({r['examples']} examples, {r['split']})"
        rows.append({"model": r["model"], "end loss": r["plain"]["end_loss"], "barrier plain": plain,
                     "barrier aligned": aligned, "note": note})  # fmt: skip
    return [*parts, to_markdown(pd.DataFrame(rows), floatfmt=".4g", index=False), ""]
