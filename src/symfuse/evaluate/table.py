"""Metric tables (pandas) from metrics JSON files or dicts written by :func:`~symfuse.evaluate.evaluate_model`."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

import pandas as pd

_COLUMNS = ("model", "dataset", "split", "primary", "score", "n", "in_domain")


def metrics_table(records: Iterable[Mapping | str | Path]) -> pd.DataFrame:
    """One row per evaluation: model, dataset, split, primary metric name and value, n, plus every scalar metric.

    Args:
        records: Metrics dicts or paths to metrics JSON files.

    Returns:
        A DataFrame sorted by dataset then model; ``score`` is the value of the row's primary metric.
    """
    rows = []
    for rec in records:
        m = json.loads(Path(rec).read_text()) if isinstance(rec, (str, Path)) else dict(rec)
        row = {k: v for k, v in m.items() if isinstance(v, (int, float, str, bool)) or v is None}
        row["score"] = m.get(m.get("primary", ""), float("nan"))
        rows.append(row)
    df = pd.DataFrame(rows)
    if df.empty:
        return pd.DataFrame(columns=list(_COLUMNS))
    first = [c for c in _COLUMNS if c in df.columns]
    df = df[first + [c for c in df.columns if c not in first]]
    keys = [c for c in ("dataset", "model") if c in df.columns]
    return df.sort_values(keys).reset_index(drop=True) if keys else df
