"""The most reliable head: each head rated on its own validation split, scored like the out-of-domain set."""

from __future__ import annotations

import shutil

import pytest

from symfuse.data import load_task_dataset
from symfuse.data.dataset import DatasetError
from symfuse.evaluate import evaluate_model, score_logits
from symfuse.evaluate.ensemble import _heads_logits, vote
from symfuse.evaluate.reliable import most_reliable, rate_heads

EKMAN_SET = load_task_dataset("goemotions_ekman").labels
KW = dict(max_examples=40, max_length=32)


def test_each_head_is_rated_on_its_own_validation_split_as_the_ood_set_scores(heads, tmp_path):
    """The rating equals the head's out-of-domain-style score (shared classes) on its own validation data; a head
    sharing no class with the set (sst2) is not rated."""
    mine = {n: heads[n] for n in ("isear", "meld", "sst2")}
    got = rate_heads(mine, {n: n for n in mine}, EKMAN_SET, **KW)
    assert list(got) == ["isear", "meld"]
    for name in got:
        want = evaluate_model(heads[name], name, split="validation", out_file=tmp_path / f"{name}.json",
                              in_domain=False, **KW)  # fmt: skip
        assert want["classes"] != load_task_dataset(name).labels  # shared classes only (meld: no neutral)
        assert got[name] == pytest.approx(want["macro_f1"], abs=1e-12)
    assert most_reliable(got) == max(got, key=got.get)
    assert most_reliable({"a": 0.5, "b": 0.5, "c": 0.1}) == "a"  # ties: the first (merge order)


def test_the_rating_reports_its_progress_head_by_head(heads):
    seen = []
    rate_heads({n: heads[n] for n in ("isear", "meld")}, {"isear": "isear", "meld": "meld"}, EKMAN_SET,
               on_progress=seen.append, **(KW | {"batch_size": 8}))  # fmt: skip
    assert seen == sorted(seen) and seen[-1] == pytest.approx(1.0) and len(seen) == 10, seen
    assert max(f for f in seen if f <= 0.5) == pytest.approx(0.5)  # isear's pass: the first half


def test_the_rating_follows_the_classes_the_target_set_asks_about(heads):
    """Rated for a set of two classes, a head is scored over those two only (by hand from its logits)."""
    got = rate_heads({"meld": heads["meld"]}, {"meld": "meld"}, ["Joy", "sadness"], **KW)
    ds = load_task_dataset("meld")
    how = dict(split="validation", device="cpu", batch_size=64, seed=13, **KW)
    [head], [z], gold = _heads_logits([heads["meld"]], ds, how)
    scores = vote([(head.names, z)], ["joy", "sadness"])
    kind = "single_label_classification"
    want = score_logits(ds, ["joy", "sadness"], kind, [scores.float()], [gold], in_domain=False)
    assert want["classes"] == ["joy", "sadness"]
    assert got["meld"] == pytest.approx(want["macro_f1"], abs=1e-12)
    assert got["meld"] != pytest.approx(rate_heads({"meld": heads["meld"]}, {"meld": "meld"}, EKMAN_SET, **KW)["meld"])


def test_a_dataset_without_a_validation_split_is_named_with_the_fix(heads, tmp_path):
    src = load_task_dataset("isear").files["train"]
    folder = tmp_path / "isear_nv"
    shutil.copytree(src.parent, folder, ignore=shutil.ignore_patterns("validation.jsonl"))
    fix = r"isear_nv: no validation split to rate its head on — add validation\.jsonl"
    with pytest.raises(DatasetError, match=fix):
        rate_heads({"isear": heads["isear"]}, {"isear": str(folder)}, EKMAN_SET, **KW)


def test_a_head_lacking_some_scored_classes_is_rated_down_in_proportion(heads):
    """Scored over the six Ekman classes, isear's head (no surprise) is rated at 5/6 of its own score; meld's (all
    six) keeps its own: each missing class counts as F1 0, as it does on the set."""
    six = ["anger", "disgust", "fear", "joy", "sadness", "surprise"]
    mine = {n: heads[n] for n in ("isear", "meld")}
    plain = rate_heads(mine, {n: n for n in mine}, EKMAN_SET, **KW)
    fixed = rate_heads(mine, {n: n for n in mine}, EKMAN_SET, scored=six, **KW)
    assert fixed["isear"] == pytest.approx(plain["isear"] * 5 / 6, abs=1e-12)
    assert fixed["meld"] == pytest.approx(plain["meld"], abs=1e-12)
