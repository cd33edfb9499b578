"""The empirical Fisher takes each example's class as the target of the head's output of that name, not position."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from symfuse.data import load_task_dataset
from symfuse.errors import DataError
from symfuse.stats import collect_stats
from symfuse.stats.io import load_stats
from tests.symfuse.train.helpers import save_tiny_base

TOKENIZER = ("vocab.txt", "tokenizer.json", "tokenizer_config.json")


def _save(model, folder, base, names):
    model.config.id2label = dict(enumerate(names))
    model.config.label2id = {n: i for i, n in enumerate(names)}
    model.save_pretrained(folder)
    for f in TOKENIZER:
        shutil.copy2(base / f, folder / f)
    return folder


def _fisher(folder, data, out):
    file = collect_stats(folder, data, ["fisher"], out, max_examples=24, batch_size=8, max_length=32, progress=False)
    return load_stats(file["fisher"])[0]


@pytest.mark.parametrize("spell", [str, str.upper])  # the dataset's spelling; another case
@pytest.mark.parametrize("data", ["dair_emotion", "goemotions_ekman"])  # one class per example; multi-hot
def test_one_function_saved_in_two_head_orders_has_one_fisher(tmp_path, data, spell):
    """The head reversed vs its rows put in the dataset's order: one function by name, the Fisher rows follow."""
    base = save_tiny_base(tmp_path / "base")
    classes = list(load_task_dataset(data).labels)
    names = [spell(c) for c in classes[::-1]]  # another order than the dataset's
    problem = "multi_label_classification" if data == "goemotions_ekman" else "single_label_classification"
    torch.manual_seed(5)
    model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=len(names), problem_type=problem)
    a = _save(model, tmp_path / "reversed", base, names)
    order = [names.index(spell(c)) for c in classes]  # the reversed head's rows in the dataset's order
    with torch.no_grad():
        model.classifier.weight.copy_(model.classifier.weight[order].clone())
        model.classifier.bias.copy_(model.classifier.bias[order].clone())
    b = _save(model, tmp_path / "dataset-order", base, classes)
    fa, fb = _fisher(a, data, tmp_path / "fa"), _fisher(b, data, tmp_path / "fb")
    assert fa.keys() == fb.keys()
    for name in fa:
        want = fb[name]
        got = fa[name][order] if name.startswith("classifier.") else fa[name]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-12, msg=name)
    assert fb["classifier.bias"].count_nonzero() == len(classes)


def test_a_class_the_head_lacks_is_refused_before_any_pass(tmp_path):
    base = save_tiny_base(tmp_path / "base")
    model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=6)
    few = _save(model, tmp_path / "few", base, ["anger", "fear", "joy", "love", "sadness", "calm"])
    with pytest.raises(DataError, match=r"few: classes the head lacks: surprise \(its classes: anger, .*--fisher-mode"):
        _fisher(few, "dair_emotion", tmp_path / "out")
    assert not (tmp_path / "out").exists()
