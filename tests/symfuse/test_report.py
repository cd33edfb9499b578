import math

import pandas as pd
import pytest

from symfuse.report import build_report, distances_table, metrics_frame, metrics_table, primary_metric, to_markdown


def _evals():
    out = []
    for strategy, variant, base in [("individual", "isear", 0.5), ("simple", "plain", 0.3), ("simple", "matched", 0.4)]:
        for ds, dom, shift in [("isear", "in", 0.0), ("meld", "in", 0.1), ("goemotions_ekman", "out", -0.1)]:
            model = variant if strategy == "individual" else f"{strategy}-{variant}"
            metrics = {"accuracy": base + shift, "macro_f1": base / 2, "n": 10, "labels": ["a"]}
            out.append(dict(model=model, strategy=strategy, variant=variant, dataset=ds, domain=dom, metrics=metrics))
    return out


def test_metrics_table_values_and_means():
    long = metrics_frame(_evals())
    assert set(long["metric"]) == {"accuracy", "macro_f1", "n"}  # lists dropped, ints kept
    assert primary_metric(long) == "accuracy"
    table = metrics_table(long, "accuracy")
    assert list(table.columns) == ["isear", "meld", "goemotions_ekman", "in-domain mean", "out-of-domain mean"]
    assert list(table.index) == [("individual", "isear"), ("simple", "plain"), ("simple", "matched")]
    assert table.loc[("simple", "matched"), "in-domain mean"] == pytest.approx((0.4 + 0.5) / 2)
    assert table.loc[("simple", "plain"), "out-of-domain mean"] == pytest.approx(0.2)


def test_metrics_frame_rejects_incomplete_record():
    with pytest.raises(ValueError, match="lacks"):
        metrics_frame([{"model": "x", "metrics": {}}])


def test_distances_reduction():
    d = distances_table(
        [
            {"model": "isear", "module": "L00.attn", "before": 4.0, "after": 1.0},
            {"model": "isear", "module": "L01.attn", "before": 4.0, "after": 3.0},
            {"model": "isear", "module": "L00.ffn", "before": 2.0, "after": 2.0},
        ]
    )
    row = d[(d["model"] == "isear") & (d["kind"] == "attn")].iloc[0]
    assert row["modules"] == 2 and row["before"] == 8.0 and row["reduction"] == pytest.approx(0.5)
    assert d[d["kind"] == "ffn"].iloc[0]["reduction"] == 0.0


def test_to_markdown_nan():
    md = to_markdown(pd.DataFrame({"a": [1.0, math.nan]}), index=False)
    assert md.splitlines() == ["| a |", "|---|", "| 1.0000 |", "| — |"]


def test_build_report_writes_files(tmp_path):
    rep = build_report(
        _evals(),
        [{"model": "isear", "module": "L00.ffn", "before": 3.0, "after": 1.0}],
        [{"stage": "finetune", "name": "finetune-isear", "seconds": 2.5}],
        tmp_path,
        facts={"run": "t"},
    )
    assert {"report.md", "metrics.csv", "metrics.png", "distances.png"} <= set(rep.files)
    csv = pd.read_csv(rep.files["metrics.csv"])
    assert len(csv) == 27  # 3 models x 3 datasets x 3 numeric metrics
    text = (tmp_path / "report.md").read_text()
    assert "Best merge (in-domain mean): **simple / matched**" in text
    assert "| simple | matched | 0.4000 | 0.5000 | 0.3000 | 0.4500 | 0.3000 |" in text
    assert (tmp_path / "metrics.png").read_bytes()[:4] == b"\x89PNG"


def test_declared_primary_metric_is_the_headline(tmp_path):
    evals = _evals()
    for ev in evals:
        ev["metrics"]["primary"] = "macro_f1"
    rep = build_report(evals, [], [], tmp_path)
    assert rep.metric == "macro_f1" and "## macro_f1 per strategy" in rep.markdown


def test_build_report_needs_evaluations(tmp_path):
    with pytest.raises(ValueError, match="no evaluation"):
        build_report([], [], [], tmp_path)


def test_matthews_of_the_in_domain_sets_beside_the_headline_metric(tmp_path):
    evals = _evals()
    for ev in evals:
        if ev["dataset"] == "isear":  # single-label in-domain: Matthews; out of domain it is not tabulated here
            ev["metrics"]["matthews"] = 0.25 if ev["strategy"] == "individual" else 0.0
        if ev["dataset"] == "goemotions_ekman":
            ev["metrics"]["matthews"] = 0.9
    md = build_report(evals, [], [], tmp_path).markdown
    section = md.split("## Matthews' correlation on the in-domain sets", 1)[1].split("\n## ", 1)[0]
    assert "| individual | isear | 0.2500 | 0.2500 |" in section and "| simple | plain | 0.0000 | 0.0000 |" in section
    assert "goemotions_ekman" not in section and "0.9" not in section
    plain = build_report(_evals(), [], [], tmp_path / "none").markdown  # no Matthews recorded: no section
    assert "Matthews" not in plain
