"""The report's findings: matching no-op verdict, matched minus plain, merges against the individual models."""

import pytest

from symfuse.report import build_report, distances_table, metrics_frame, metrics_table
from symfuse.report_findings import NOOP_WHY, matched_minus_plain, matching_effect, versus_individuals

# (strategy, variant) -> scores on isear, meld (in domain) and goemotions_ekman (out of domain)
SCORES = {
    ("individual", "isear"): (0.8, 0.3, 0.4),
    ("individual", "meld"): (0.2, 0.6, 0.5),
    ("simple", "plain"): (0.6, 0.5, 0.45),
    ("simple", "matched"): (0.6, 0.5, 0.45),
    ("fisher", "plain"): (0.7, 0.56, 0.55),
    ("fisher", "matched"): (0.72, 0.54, 0.5),
}
NOOP = [  # attention moves 0.3 %, FFN not at all: a shared base
    {"model": "isear", "module": "L00.attn", "before": 60.0, "after": 59.8},
    {"model": "isear", "module": "L01.attn", "before": 40.0, "after": 39.9},
    {"model": "isear", "module": "L00.ffn", "before": 50.0, "after": 50.0},
]
MOVED = [
    {"model": "isear", "module": "L00.attn", "before": 100.0, "after": 90.0},
    {"model": "isear", "module": "L00.ffn", "before": 50.0, "after": 49.0},
]


def _evals():
    out = []
    for (strategy, variant), scores in SCORES.items():
        model = variant if strategy == "individual" else f"{strategy}-{variant}"
        for ds, dom, score in zip(("isear", "meld", "goemotions_ekman"), ("in", "in", "out"), scores, strict=True):
            out.append(dict(model=model, strategy=strategy, variant=variant, dataset=ds, domain=dom,
                            metrics={"accuracy": score}))  # fmt: skip
    return out


def _table():
    return metrics_table(metrics_frame(_evals()), "accuracy")


def test_matching_that_moved_under_one_percent_is_a_noop():
    effect = matching_effect(distances_table(NOOP))
    assert effect.noop
    assert effect.largest_move == pytest.approx(0.003)
    assert effect.where == "isear / attn"
    assert effect.per_kind == pytest.approx({"attn": 0.003, "ffn": 0.0})


def test_matching_that_moved_weights_is_not_a_noop():
    effect = matching_effect(distances_table(MOVED))
    assert not effect.noop
    assert effect.largest_move == pytest.approx(0.1) and effect.where == "isear / attn"
    assert effect.per_kind == pytest.approx({"attn": 0.1, "ffn": 0.02})


def test_no_distances_no_verdict():
    assert matching_effect(distances_table([])) is None
    assert matching_effect(distances_table([{"model": "a", "module": "L0.ffn", "before": 0.0, "after": 0.0}])) is None


def test_matched_minus_plain_per_strategy():
    delta = matched_minus_plain(_table())
    assert list(delta.index) == ["fisher", "simple"]
    assert list(delta.columns) == ["Δ in-domain mean", "Δ out-of-domain mean"]
    assert delta.loc["simple"].tolist() == [0.0, 0.0]
    assert delta.loc["fisher", "Δ in-domain mean"] == pytest.approx(0.0)
    assert delta.loc["fisher", "Δ out-of-domain mean"] == pytest.approx(-0.05)


def test_matched_minus_plain_needs_both_variants():
    table = _table().drop(index=("fisher", "matched"))
    assert list(matched_minus_plain(table).index) == ["simple"]


def test_merges_against_individual_own_domain_and_best_ood():
    vs = versus_individuals(_table())
    assert vs.own == pytest.approx({"isear": 0.8, "meld": 0.6})
    assert vs.individual_mean == pytest.approx(0.7)
    assert vs.best_ood == pytest.approx(0.5) and vs.best_ood_model == "meld"
    m = vs.merges
    assert m.loc[("simple", "plain"), "% of individual mean"] == pytest.approx(100 * 0.55 / 0.7)
    assert m.loc[("fisher", "plain"), "% of individual mean"] == pytest.approx(90.0)
    # strictly better than the best individual OOD score only; equal (fisher/matched: 0.5) does not beat it
    assert m["beats best individual OOD"].to_dict() == {
        ("fisher", "plain"): "**yes**",
        ("fisher", "matched"): "no",
        ("simple", "plain"): "no",
        ("simple", "matched"): "no",
    }


def test_no_individuals_no_comparison():
    assert versus_individuals(_table().drop(index="individual", level=0)) is None


def test_report_says_matching_was_a_noop(tmp_path):
    text = build_report(_evals(), NOOP, [], tmp_path).markdown
    assert "**Matching was a no-op**: it moved the distance to the anchor by less than 1 %" in text
    assert "largest move 0.30 % (isear / attn); closer to the anchor by attn +0.3 %, ffn +0.0 %" in text
    assert NOOP_WHY in text and "matched merges equal plain merges" in text
    assert "| simple | +0.0000 | +0.0000 |" in text and "| fisher | +0.0000 | -0.0500 |" in text
    assert "- Individual models on their own test set: isear 0.8000, meld 0.6000; mean **0.7000**." in text
    assert "- Best individual out of domain: meld **0.5000**." in text
    assert "| fisher | plain | 0.6300 | 90.0 % | 0.5500 | **yes** |" in text
    assert "| simple | plain | 0.5500 | 78.6 % | 0.4500 | no |" in text
    assert "Merges that beat the best individual out of domain: fisher / plain." in text
    assert "agree to 4 decimals" not in text  # fisher OOD differs by 0.05


def test_report_says_when_matched_equals_plain(tmp_path):
    evals = [ev for ev in _evals() if ev["strategy"] != "fisher"]
    assert (
        "Matched and plain merges agree to 4 decimals for every strategy."
        in build_report(evals, NOOP, [], tmp_path).markdown
    )


def test_report_says_matching_moved_the_weights(tmp_path):
    text = build_report(_evals(), MOVED, [], tmp_path).markdown
    assert "no-op" not in text and NOOP_WHY not in text
    assert "Matching moved the weights: largest move 10.00 % (isear / attn)" in text


def test_report_without_distances_gives_no_verdict(tmp_path):
    text = build_report(_evals(), [], [], tmp_path).markdown
    assert "Did matching change anything?" not in text and "## Matched minus plain (accuracy)" in text
