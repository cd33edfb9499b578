"""A head that names the data's classes in another order or case is scored by name, loss included; an emotion set
scored out of domain says which classes both name but the Ekman rule leaves out."""

import json
import logging
import shutil

import torch
import torch.nn.functional as F

from symfuse.evaluate import evaluate_model
from tests.cli.helpers import toy_dataset
from tests.tiny import save_tiny_text_classifier


def _named(folder, names):
    config = json.loads((folder / "config.json").read_text())
    config["id2label"] = dict(enumerate(names))
    config["label2id"] = {n: i for i, n in enumerate(names)}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_the_loss_of_a_head_naming_the_classes_in_another_order_and_case_reads_them_by_name(tmp_path):
    data = toy_dataset(tmp_path / "d", ("anger", "joy"))  # classes in this order: anger, joy
    plain = _named(save_tiny_text_classifier(tmp_path / "m", seed=3), ["anger", "joy"])
    other = _named(shutil.copytree(plain, tmp_path / "m2"), ["ANGER", "JOY"])
    want = evaluate_model(plain, str(data), out_file=tmp_path / "a.json")
    got = evaluate_model(other, str(data), out_file=tmp_path / "b.json")
    assert want["loss"] is not None and got["loss"] == want["loss"] and got["accuracy"] == want["accuracy"]
    # the same weights with output 0 called joy: the loss is that of the swapped logits (computed here by hand)
    swapped = _named(shutil.copytree(plain, tmp_path / "m3"), ["joy", "anger"])
    got = evaluate_model(swapped, str(data), out_file=tmp_path / "c.json")
    from symfuse.evaluate.predict import load_task_model

    net, tok = load_task_model(plain)
    texts = [json.loads(line)["text"] for line in (data / "test.jsonl").read_text().splitlines()]
    gold = torch.tensor([0 if json.loads(line)["label"] == "joy" else 1
                         for line in (data / "test.jsonl").read_text().splitlines()])  # fmt: skip
    with torch.no_grad():
        logits = net(**tok(texts, padding=True, return_tensors="pt")).logits
    assert abs(got["loss"] - float(F.cross_entropy(logits, gold))) < 1e-5


def test_classes_the_ekman_rule_leaves_out_are_named(tmp_path, caplog):
    data = toy_dataset(tmp_path / "d", ("anger", "joy", "neutral"))
    meta = json.loads((data / "meta.json").read_text())
    (data / "meta.json").write_text(json.dumps({**meta, "labels": [*meta["labels"], "love"]}))  # one unused class
    model = _named(save_tiny_text_classifier(tmp_path / "m", num_labels=3), ["anger", "joy", "neutral"])
    with caplog.at_level(logging.WARNING):
        metrics = evaluate_model(model, str(data), out_file=tmp_path / "e.json")
    assert not metrics["in_domain"] and "neutral" not in metrics["classes"]
    assert any("left out though both name them: neutral" in r.getMessage() for r in caplog.records)
