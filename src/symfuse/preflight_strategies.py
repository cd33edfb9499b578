"""The run's strategies against its datasets and statistics, checked before anything trains (see preflight)."""

from __future__ import annotations

from symfuse.config import RunConfig


def strategy_problems(config: RunConfig) -> list[str]:
    """Each strategy's statistics are collected and it merges as many models as the run has datasets (slerp two).

    No dataset is named like a merged model (``<strategy>-<variant>``): their evaluations would share records.
    """
    from symfuse.merge.registry import MERGERS
    from symfuse.report import VARIANT_ORDER

    kinds = config.stats.kinds
    lines = [f"datasets: {d} is the name of a merged model of the run (strategy {d.rpartition('-')[0]}) — its "
             "evaluations would share a record with that merge's; rename the dataset"
             for d in config.dataset_names
             if d.rpartition("-")[2] in VARIANT_ORDER and d.rpartition("-")[0] in MERGERS]  # fmt: skip
    lines += [f"stats.kinds: {', '.join(kinds)} lacks {', '.join(sorted(lack))}, which {s} reads — add "
             f"{', '.join(sorted(lack))} to stats.kinds (or drop {s} from strategies)"
             for s in config.strategies if (lack := MERGERS[s].required_stats - set(kinds))]  # fmt: skip
    n = len(config.datasets)
    bad = [s for s in config.strategies if not MERGERS[s].merges(n)]
    if not bad:
        return lines
    if n < 2 and all(MERGERS[s].model_count[0] >= 2 for s in bad):
        return [*lines, f"datasets: {n} dataset — a run merges one model per dataset, two or more; add a dataset "
                "(or bring a checkpoint: {name, checkpoint})"]  # fmt: skip
    for s in bad:
        words = MERGERS[s].count_words()
        noun = "model" if words == "exactly one" else "models"
        fit = words.removeprefix("exactly ") + (" dataset" if words == "exactly one" else " datasets")
        lines.append(f"strategies: {s} merges {words} {noun}, and this run has {n} datasets (one model each) — drop "
                     f"{s} from strategies, or run it on {fit}")  # fmt: skip
    return lines


def weights_problems(config: RunConfig) -> list[str]:
    """``merge_params.<s>.weights``: one non-negative weight per dataset, with a positive sum.

    The merge task refused them after the fine-tunes and statistics, in a line that named no field.
    """
    n, lines = len(config.datasets), []
    for s in config.strategies:
        w = config.strategy_params(s).get("weights")
        if w is not None and (len(w) != n or min(w, default=0) < 0 or sum(w) <= 0):
            lines.append(f"merge_params.{s}.weights: {w} — give {n} non-negative numbers (one per dataset, in the "
                         "order of datasets) with a positive sum")  # fmt: skip
    return lines
