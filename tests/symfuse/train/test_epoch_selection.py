"""A dataset without a validation split: the best epoch is picked on records held out of train, never on test."""

import json
import logging
import re
from dataclasses import replace

import pytest
from typer.testing import CliRunner

import symfuse.cli.train  # noqa: F401  (registers finetune)
from symfuse.cli import app
from symfuse.data import iter_batches, load_task_dataset, load_tokenizer
from symfuse.data.batches import encode_split
from symfuse.data.holdout import HOLDOUT_SPLIT, holdout_indices
from symfuse.evaluate import load_task_model, run_model
from symfuse.train import TRAIN_REPORT, FinetuneConfig, finetune, train_model
from symfuse.train.finetune import _build_model
from tests.symfuse.train.helpers import no_validation_dataset, save_tiny_base

CFG = dict(epochs=2, lr=1e-3, batch_size=4, max_length=16, progress=False)


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory):
    return save_tiny_base(tmp_path_factory.mktemp("tiny") / "base")


class _Untouchable:
    """A split that fails the test as soon as anything reads it."""

    def __len__(self):
        raise AssertionError("the test split was read during fine-tuning")

    def __getattr__(self, name):
        raise AssertionError(f"the test split was read during fine-tuning ({name})")


def _loss(model, tok, ds, rows) -> float:
    view = replace(ds, splits={"rows": rows})
    return run_model(model, list(iter_batches(encode_split(view, tok, "rows", 16), 64)), ds.problem_type)[2]


def test_finetune_without_validation_picks_the_epoch_on_held_out_train_records(tiny_base, tmp_path, caplog):
    data = no_validation_dataset(tmp_path / "nv", 20)
    with caplog.at_level(logging.INFO, logger="symfuse"):
        out = finetune(tiny_base, str(data), tmp_path / "ft", FinetuneConfig(**CFG))
    report = json.loads((out / TRAIN_REPORT).read_text())
    assert report["selection"] == {"split": HOLDOUT_SPLIT, "examples": 2, "held_out_of_train": 2,
                                   "train_examples": 18, "fraction": 0.1, "stratified": True}  # fmt: skip
    assert report["train_examples"] == 18 and [e["split"] for e in report["epochs"]] == [HOLDOUT_SPLIT] * 2
    said = [r for r in caplog.records if "no validation split" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO, [r.getMessage() for r in said]
    assert "2 of 20 train records" in said[0].getMessage() and "test split is not read" in said[0].getMessage()
    # the kept epoch's recorded loss is the saved model's loss on the held-out train records; on the test split
    # (labels flipped) it is far from it
    ds = load_task_dataset(str(data))
    held = holdout_indices(20, 13, [str(x) for x in ds.splits["train"]["label"]])
    model, tok = load_task_model(out)
    best = next(e for e in report["epochs"] if e["best"])
    assert _loss(model, tok, ds, ds.splits["train"].select(held)) == pytest.approx(best["val_loss"], abs=1e-5)
    assert abs(_loss(model, tok, ds, ds.splits["test"]) - best["val_loss"]) > 1e-3


def test_train_model_never_reads_the_test_split(tiny_base, tmp_path):
    ds = load_task_dataset(str(no_validation_dataset(tmp_path / "nv", 20)))
    ds.splits["test"] = _Untouchable()
    cfg = FinetuneConfig(**CFG)
    _, history = train_model(_build_model(tiny_base, ds, cfg), ds, load_tokenizer(tiny_base), cfg)
    assert [h["split"] for h in history] == [HOLDOUT_SPLIT] * 2 and sum(h["best"] for h in history) == 1


def test_one_train_record_scores_no_epoch_and_keeps_the_last(tiny_base, tmp_path, caplog):
    data = no_validation_dataset(tmp_path / "one", 1)
    with caplog.at_level(logging.INFO, logger="symfuse"):
        out = finetune(tiny_base, str(data), tmp_path / "ft", FinetuneConfig(**CFG))
    report = json.loads((out / TRAIN_REPORT).read_text())
    assert report["selection"] == {"split": None, "examples": 0, "held_out_of_train": 0, "train_examples": 1}
    assert [(e["split"], e["best"], "val_loss" in e) for e in report["epochs"]] == [(None, False, False),
                                                                                    (None, True, False)]  # fmt: skip
    said = [r for r in caplog.records if "too few to hold any out" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING and "last one is kept" in said[0].getMessage()


def test_the_finetune_command_says_where_the_epochs_were_scored(tiny_base, tmp_path):
    common = ["finetune", str(tiny_base), "--epochs", "2", "--lr", "1e-3", "--max-length", "16", "--data"]
    res = CliRunner().invoke(app, [*common, str(no_validation_dataset(tmp_path / "nv", 20)), "--out", tmp_path / "a"])
    assert res.exit_code == 0, res.output
    epochs = re.findall(r"epoch \d+: train loss .*", res.output)  # (after the progress bars)
    assert len(epochs) == 2 and all("held-out loss" in line for line in epochs), res.output
    assert sum("(best)" in line for line in epochs) == 1
    res = CliRunner().invoke(app, [*common, str(no_validation_dataset(tmp_path / "one", 1)), "--out", tmp_path / "b"])
    assert res.exit_code == 0, res.output
    epochs = re.findall(r"epoch \d+: train loss .*", res.output)  # (after the progress bars)
    assert len(epochs) == 2 and not any("loss" in line.split("train loss")[1] for line in epochs), res.output
    assert epochs[1].endswith("(best)")
