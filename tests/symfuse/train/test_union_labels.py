"""Fine-tuning with the union label space: one binary output per class of the union, loss on the dataset's own."""

import json

import pytest
import torch
from safetensors.torch import load_file

from symfuse.data import load_task_dataset
from symfuse.data.labels import EMOTION_SHARED, LABEL_SPACE_KEY, union_label_names
from symfuse.evaluate import evaluate_model
from symfuse.train import FinetuneConfig, finetune
from symfuse.train.finetune import _build_model
from tests.symfuse.train.helpers import save_tiny_base


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory):
    return save_tiny_base(tmp_path_factory.mktemp("tiny") / "base")


@pytest.fixture(scope="module")
def union():
    return union_label_names(load_task_dataset(n).labels for n in ("crowdflower", "meld"))


def _cfg(union, **kw):
    return FinetuneConfig(epochs=1, lr=1e-3, batch_size=8, max_length=32, max_train_examples=48,
                          max_eval_examples=24, label_space=union, progress=False, **kw)  # fmt: skip


def test_union_finetune_trains_only_the_dataset_classes(tiny_base, union, tmp_path):
    meld = load_task_dataset("meld", max_train_examples=48)
    assert union[:13] == load_task_dataset("crowdflower").labels and "disgust" in union and len(union) == 16
    start = _build_model(tiny_base, meld, _cfg(union)).state_dict()
    out = finetune(tiny_base, "meld", tmp_path / "m", _cfg(union))
    config = json.loads((out / "config.json").read_text())
    assert len(config["id2label"]) == len(union) and config["problem_type"] == "multi_label_classification"
    space = config[LABEL_SPACE_KEY]
    assert space["labels"] == union and space["datasets"] == {"meld": meld.labels}
    assert space["learned"] == [c in meld.labels for c in union]
    got = load_file(str(out / "model.safetensors"))
    for i, c in enumerate(union):
        w0, w1 = start["classifier.weight"][i], got["classifier.weight"][i]
        if c in meld.labels:
            assert not torch.allclose(w0, w1)
        else:  # no loss term, so no gradient: the bias stays, the weight only shrinks by weight decay
            assert torch.equal(got["classifier.bias"][i], start["classifier.bias"][i])
            torch.testing.assert_close(w1 / w1.norm(), w0 / w0.norm())
            assert w1.norm() <= w0.norm()
    train = json.loads((out / "symfuse_train.json").read_text())
    assert train["label_space"] == "union" and train["epochs"][0]["val_loss"] > 0

    in_domain = evaluate_model(out, "meld", max_examples=24, max_length=32)
    assert in_domain["in_domain"] and in_domain["classes"] == meld.labels and "matthews" in in_domain
    ood = evaluate_model(out, "goemotions_ekman", max_examples=24, max_length=32)
    assert not ood["in_domain"] and ood["classes"] == list(EMOTION_SHARED)
    cross = evaluate_model(out, "crowdflower", max_examples=48, max_length=32)  # learned from meld only
    assert not cross["in_domain"] and set(cross["classes"]) == {"anger", "sadness", "surprise"}


def test_head_init_same_by_default_different_with_a_head_seed(tiny_base, union):
    meld, crowd = load_task_dataset("meld"), load_task_dataset("crowdflower")
    a = _build_model(tiny_base, meld, _cfg(union)).classifier.weight
    b = _build_model(tiny_base, crowd, _cfg(union)).classifier.weight
    c = _build_model(tiny_base, crowd, _cfg(union, head_seed=99)).classifier.weight
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_a_union_without_the_dataset_classes_fails_before_training(tiny_base, tmp_path):
    with pytest.raises(ValueError, match=r"meld: classes \['disgust', 'fear', 'joy'\] are not in the label space"):
        finetune(tiny_base, "meld", tmp_path / "m", _cfg(load_task_dataset("crowdflower").labels))
    assert not (tmp_path / "m").exists()
