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


def test_a_fisher_the_head_cannot_give_on_the_data_is_refused_before_any_pass(tmp_path):
    """A causal LM on class data was an internal error (a shape mismatch in the pass); single-label data on a
    multi-label head, torch's "Target size ... must be the same as input size"."""
    from transformers import AutoModelForCausalLM

    from tests.tiny import tiny_config

    base = save_tiny_base(tmp_path / "base")
    lm = _save(AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=30522)), tmp_path / "lm", base, [])
    with pytest.raises(DataError, match=r"lm: a causal language model has no task head to take the Fisher of on "):
        _fisher(lm, "dair_emotion", tmp_path / "out")
    names = list(load_task_dataset("goemotions_ekman").labels)
    model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=len(names),
                                                               problem_type="multi_label_classification")  # fmt: skip
    multi = _save(model, tmp_path / "multi", base, names)
    with pytest.raises(DataError, match=r"multi: a multi-label head, and ekman_single is single-label: its targets"):
        _fisher(multi, str(_single_label_copy("goemotions_ekman", tmp_path / "ekman_single")), tmp_path / "out")
    assert not (tmp_path / "out").exists()
    file = collect_stats(multi, str(tmp_path / "ekman_single"), ["fisher"], tmp_path / "out", max_examples=8,
                         batch_size=8, max_length=16, fisher_mode="sampled", progress=False)  # fmt: skip
    assert file["fisher"].is_file()  # targets drawn from the head: any data will do


def _single_label_copy(name: str, folder):
    """``name``'s test split with one class per record (its first), as a dataset folder."""
    import json

    ds = load_task_dataset(name)
    folder.mkdir()
    rows = [{"text": r["text"], "label": r["label"][0]} for r in ds.splits["test"].select(range(16)) if r["label"]]
    for split in ("train", "test"):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "meta.json").write_text(json.dumps({"task": "classification", "labels": ds.labels}))
    return folder
