"""Every merged model folder carries a README.md model card: HF-style front matter, inputs, strategy, symmetries."""

from __future__ import annotations

import json

import pytest
import transformers

from symfuse.merge import merge_checkpoints
from symfuse.model_card import read_front_matter
from tests.tiny import tiny_config


def _labelled(folder, labels, seed, epochs=None):
    cfg = tiny_config("bert", num_labels=len(labels))
    cfg.id2label = dict(enumerate(labels))
    cfg.label2id = {v: k for k, v in cfg.id2label.items()}
    transformers.set_seed(seed)
    transformers.BertForSequenceClassification(cfg).save_pretrained(folder)
    if epochs is not None:  # as symfuse.train.finetune writes it
        (folder / "symfuse_train.json").write_text(json.dumps({"epochs": epochs}))
    return folder


def test_merged_folder_has_a_model_card(tmp_path):
    labels = ["anger", "joy", "sadness"]
    a = _labelled(tmp_path / "isear", labels, 0, epochs=[
        {"epoch": 1, "val_loss": 1.2, "macro_f1": 0.41, "seconds": 3.0, "best": False},
        {"epoch": 2, "val_loss": 1.1, "macro_f1": 0.52, "seconds": 3.0, "best": True},
    ])  # fmt: skip
    b = _labelled(tmp_path / "meld", labels, 1)
    card = {"base_model": "minilm", "symmetries": ["rotation", "scaling"], "extra": {"run_id": "r1"}}
    out = merge_checkpoints("simple", [a, b], tmp_path / "out", card=card)
    text = (out / "README.md").read_text()
    front = read_front_matter(text)
    assert front["base_model"] == "minilm" and front["library_name"] == "transformers"
    assert front["pipeline_tag"] == "text-classification" and front["datasets"] == ["isear", "meld"]
    assert "merge-simple" in front["tags"] and "symmetry-matched" in front["tags"]
    assert front["symfuse"]["strategy"] == "simple" and front["symfuse"]["run_id"] == "r1"
    assert front["symfuse"]["symmetries"] == ["rotation", "scaling"]
    assert front["symfuse"]["inputs"] == [str(a), str(b)] and front["symfuse"]["heads"] == "merged"
    # the kept epoch's validation metrics of the input that has them; '-' for the other
    assert f"| isear | isear | `{a}` | 1.1000 | 0.5200 |" in text
    assert f"| meld | meld | `{b}` | - | - |" in text
    assert "`rotation`, `scaling`" in text and "anger, joy, sadness" in text
    # the folder still loads as a model (the card is just a file beside the weights)
    assert transformers.AutoModelForSequenceClassification.from_pretrained(str(out)).config.num_labels == 3


def test_plain_merge_card_says_no_symmetries_and_per_dataset_heads(tmp_path):
    a = _labelled(tmp_path / "emotion", ["anger", "joy"], 0)
    b = _labelled(tmp_path / "sst2", ["negative", "positive", "neutral"], 1)
    out = merge_checkpoints("simple", [a, b], tmp_path / "out")
    text = (out / "README.md").read_text()
    front = read_front_matter(text)
    assert "base_model" not in front and front["symfuse"]["symmetries"] == []
    assert front["symfuse"]["heads"] == "per-dataset" and "symmetry-matched" not in front["tags"]
    assert "none (inputs merged as they are)" in text and "heads/<dataset>/" in text


def test_card_without_front_matter_is_refused():
    with pytest.raises(ValueError, match="no YAML front matter"):
        read_front_matter("# just a title\n")
