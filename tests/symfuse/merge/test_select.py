"""Greedy subset selection on constructed cases whose best subset is known."""

import itertools

import pytest
import torch

from symfuse.merge.select import greedy_order, select_greedy


def test_greedy_picks_the_known_best_subset_of_averaged_vectors():
    # Each "model" is a vector; merging = averaging; score = -distance of the average to the target. a and c err on
    # opposite sides (their average is closer than either); b is off, d is the worst.
    target = torch.tensor([1.0, 1.0])
    models = {
        "a": torch.tensor([1.1, 1.0]),
        "b": torch.tensor([0.0, 3.0]),
        "c": torch.tensor([0.8, 1.0]),
        "d": torch.tensor([-4.0, -4.0]),
    }

    def score(names):
        return -float((torch.stack([models[n] for n in names]).mean(0) - target).norm())

    calls = []

    def merge_and_score(names):
        calls.append(tuple(names))
        return score(names)

    own = {n: score([n]) for n in models}
    sel = select_greedy(own, merge_and_score)
    best = max((s for k in range(1, 5) for s in itertools.combinations(models, k)), key=score)
    assert set(sel.chosen) == set(best) == {"a", "c"}
    assert sel.score == pytest.approx(-0.05, abs=1e-6)
    # order by own score: a (-0.1), c (-0.2), b, d
    assert [s.added for s in sel.path] == ["a", "c", "b", "d"]
    assert [s.kept for s in sel.path] == [True, True, False, False]
    assert calls == [("a", "c"), ("a", "c", "b"), ("a", "c", "d")]
    assert sel.path[2].subset == ("a", "c", "b") and sel.path[2].score == pytest.approx(score(["a", "b", "c"]))
    assert sel.to_json()["chosen"] == ["a", "c"]


def test_a_model_that_never_helps_leaves_the_best_single_model():
    sel = select_greedy({"x": 0.5, "y": 0.7, "z": 0.1}, lambda names: 0.6)
    assert sel.chosen == ("y",) and sel.score == 0.7
    assert [(s.added, s.kept) for s in sel.path] == [("y", True), ("x", False), ("z", False)]


def test_bad_scores_are_clear_errors():
    with pytest.raises(ValueError, match="at least one model"):
        select_greedy({}, lambda names: 0.0)
    with pytest.raises(ValueError, match="not finite"):
        greedy_order({"a": float("nan")})
    with pytest.raises(ValueError, match=r"merge of \['a', 'b'\] scored nan"):
        select_greedy({"a": 1.0, "b": 0.5}, lambda names: float("nan"))
