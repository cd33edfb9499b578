"""Epoch selection without a validation split: a seeded slice held out of train, never the test split."""

import json
from collections import Counter

from symfuse.data import load_task_dataset
from symfuse.data.holdout import HOLDOUT_SPLIT, epoch_selection, holdout_indices
from tests.symfuse.train.helpers import no_validation_dataset


def test_holdout_indices_are_seeded_ten_percent_at_least_one_and_leave_one_to_train():
    assert holdout_indices(40, 13) == holdout_indices(40, 13) != holdout_indices(40, 14)
    assert len(holdout_indices(40, 13)) == 4 and len(set(holdout_indices(40, 13))) == 4
    assert holdout_indices(40, 13) == sorted(holdout_indices(40, 13)) and max(holdout_indices(40, 13)) < 40
    assert [len(holdout_indices(n, 0)) for n in (2, 3, 9, 10, 19, 20, 25)] == [1, 1, 1, 1, 1, 2, 2]
    assert holdout_indices(1, 13) == [] and holdout_indices(0, 13) == []  # nothing to hold out: one must train
    assert len(holdout_indices(4, 0, fraction=0.99)) == 3  # never the whole train split


def test_holdout_is_stratified_by_label():
    labels = ["a"] * 30 + ["b"] * 10
    for seed in range(5):
        held = holdout_indices(40, seed, labels)
        assert Counter(labels[i] for i in held) == {"a": 3, "b": 1}, seed
    # the largest remainder would take the only 'b' (0.4 > 0.2): a label keeps its last train record when another
    # label can give one
    five = ["a", "a", "a", "b", "c"]
    for seed in range(5):
        assert [five[i] for i in holdout_indices(5, seed, five, fraction=0.5)] == ["a", "a"], seed


def texts(rows) -> list[str]:
    return list(rows["text"])


def test_without_validation_the_epochs_are_scored_on_train_records_never_test(tmp_path):
    ds = load_task_dataset(str(no_validation_dataset(tmp_path / "nv", 20)))
    sel = epoch_selection(ds, 13)
    train, test, scored = texts(ds.splits["train"]), texts(ds.splits["test"]), texts(sel.scored)
    assert sel.split == HOLDOUT_SPLIT and sel.held_out == 2 and sel.stratified
    assert set(scored) <= set(train) and not set(scored) & set(test)
    assert sorted(scored + texts(sel.train)) == sorted(train)  # disjoint, together the train split
    assert Counter(sel.scored["label"]) == {"joy": 1, "anger": 1}
    assert set(sel.splits) == {"train", HOLDOUT_SPLIT}  # what a fine-tune reads: no test split
    assert texts(epoch_selection(ds, 13).scored) == scored != texts(epoch_selection(ds, 14).scored)
    assert sel.to_json(None) == {"split": HOLDOUT_SPLIT, "examples": 2, "held_out_of_train": 2,
                                 "train_examples": 18, "fraction": 0.1, "stratified": True}  # fmt: skip
    assert sel.to_json(1)["examples"] == 1  # max_eval_examples caps the records scored
    line = sel.describe("nv", 13)
    assert "no validation split" in line and "2 of 20 train records" in line and "test split is not read" in line


def test_max_train_examples_caps_first_and_the_slice_comes_out_of_the_capped_records(tmp_path):
    ds = load_task_dataset(str(no_validation_dataset(tmp_path / "nv", 40)), max_train_examples=20, seed=13)
    sel = epoch_selection(ds, 13)
    assert sel.held_out == 2 and len(sel.train) == 18
    assert set(texts(sel.scored)) | set(texts(sel.train)) == set(texts(ds.splits["train"]))


def test_a_validation_split_is_used_as_it_is_and_too_little_train_holds_nothing_out(tmp_path):
    data = no_validation_dataset(tmp_path / "v", 20)
    (data / "validation.jsonl").write_text((data / "test.jsonl").read_text().replace("test ", "val "))
    ds = load_task_dataset(str(data))
    sel = epoch_selection(ds, 13)
    assert sel.split == "validation" and sel.held_out == 0 and texts(sel.train) == texts(ds.splits["train"])
    assert texts(sel.scored) == texts(ds.splits["validation"]) and sel.describe("v", 13) is None
    one = no_validation_dataset(tmp_path / "one", 1)
    sel = epoch_selection(load_task_dataset(str(one)), 13)
    assert sel.split is None and sel.scored is None and len(sel.train) == 1 and set(sel.splits) == {"train"}
    assert sel.to_json() == {"split": None, "examples": 0, "held_out_of_train": 0, "train_examples": 1}
    assert "too few to hold any out" in sel.describe("one", 13) and "last one is kept" in sel.describe("one", 13)
    multi = tmp_path / "multi"  # multi-label: a plain seeded draw, not stratified
    multi.mkdir()
    rows = [{"text": f"t{i}", "label": ["joy"] if i % 2 else ["anger", "joy"]} for i in range(10)]
    (multi / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    sel = epoch_selection(load_task_dataset(f"train={multi / 'train.jsonl'}"), 13)
    assert sel.split == HOLDOUT_SPLIT and sel.held_out == 1 and not sel.stratified


def test_a_validation_split_read_from_the_train_file_is_not_held_out(tmp_path):
    """A single data file serves every split: finetune --data one.jsonl picked its best epoch on the records it
    trained on (symfuse_train.json: split validation, held_out_of_train 0), and called it "val loss"."""
    data = no_validation_dataset(tmp_path / "d", 20)
    single = load_task_dataset(str(data / "train.jsonl"))
    assert set(single.splits) == {"train", "validation", "test"}  # read as any split (evaluate --data one.jsonl)
    named = load_task_dataset(f"train={data / 'train.jsonl'},validation={tmp_path / 'd' / '..' / 'd' / 'train.jsonl'}")
    for ds in (single, named):
        sel = epoch_selection(ds, 13)
        assert sel.split == HOLDOUT_SPLIT and sel.held_out == 2, sel.split
        assert not set(texts(sel.scored)) & set(texts(sel.train))
