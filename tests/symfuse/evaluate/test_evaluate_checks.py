"""``evaluate_model`` refuses a head and a dataset without a shared class before the model runs over the split."""

from __future__ import annotations

import pytest

import symfuse.evaluate.evaluate as E
from symfuse.data.dataset import DatasetError
from tests.cli.helpers import toy_dataset
from tests.tiny import save_tiny_text_classifier


def test_no_shared_class_is_refused_before_the_model_runs(tmp_path, monkeypatch):
    model = save_tiny_text_classifier(tmp_path / "m", num_labels=2)  # classes LABEL_0, LABEL_1
    data = toy_dataset(tmp_path / "d", labels=("anger", "joy"))

    def run_model(*args, **kwargs):
        raise AssertionError("the model ran before the label spaces were compared")

    monkeypatch.setattr(E, "run_model", run_model)
    with pytest.raises(DatasetError, match="share none with the dataset's") as info:
        E.evaluate_model(model, str(data))
    assert "--labels-from" in str(info.value)
    # named as the dataset's own classes, the same head is scored (it runs)
    with pytest.raises(AssertionError, match="the model ran"):
        E.evaluate_model(model, str(data), labels_from=str(data))
