"""``evaluate_model`` refuses a head and a dataset without a shared class before the model runs over the split."""

from __future__ import annotations

import pytest
import torch

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


def test_texts_longer_than_the_models_positions_are_cut_there(tmp_path):
    """A tiny classifier reads 64 positions; the default max_length is 128 and the texts run to ~300 tokens."""
    import json

    from symfuse.data.batches import config_positions
    from symfuse.train import FinetuneConfig, finetune

    model = save_tiny_text_classifier(tmp_path / "m", num_labels=2)
    data = toy_dataset(tmp_path / "d", labels=("LABEL_0", "LABEL_1"))
    for split in ("train", "validation", "test"):
        rows = [{"text": " ".join(["word"] * 300 + [str(i)]), "label": f"LABEL_{i % 2}"} for i in range(6)]
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    metrics = E.evaluate_model(model, str(data), max_length=128)
    assert metrics["n"] == 6 and 0 <= metrics["accuracy"] <= 1 and metrics["max_length"] == 64  # as used
    cfg = FinetuneConfig(epochs=1, batch_size=3, max_length=512, max_train_examples=6, progress=False)
    report = json.loads((finetune(model, str(data), tmp_path / "ft", cfg) / "symfuse_train.json").read_text())
    assert len(report["epochs"]) == 1
    # RoBERTa's position ids start after the padding index: 2 of its 514 embeddings are never read
    assert config_positions({"model_type": "roberta", "max_position_embeddings": 514, "pad_token_id": 1}) == 512
    assert config_positions({"model_type": "gpt2", "n_positions": 1024}) == 1024
    assert config_positions({"model_type": "bert"}) is None


def test_a_token_head_of_tags_seqeval_cannot_score_is_refused_before_the_model_runs(tmp_path, monkeypatch):
    """A head of IO tags ('PER') predicted tags seqeval reads as outside every entity: entity F1 0, exit 0."""
    import json

    import transformers as T

    from symfuse.checkpoint import resolve_checkpoint
    from symfuse.errors import CheckpointError
    from tests.tiny import tiny_config

    tok = T.AutoTokenizer.from_pretrained(str(resolve_checkpoint("minilm")))
    for name, tags in (("m", ["O", "PER", "LOC"]), ("unnamed", None)):
        named = {"id2label": dict(enumerate(tags))} if tags else {}
        T.BertForTokenClassification(tiny_config("bert", vocab_size=30522, num_labels=3, **named)).save_pretrained(
            tmp_path / name
        )
        tok.save_pretrained(tmp_path / name)
    data = tmp_path / "d"
    data.mkdir()
    rows = [{"tokens": ["Ann", "saw", "Rome"], "tags": ["B-PER", "O", "B-LOC"]}] * 4
    for split in ("train", "validation", "test"):
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (data / "meta.json").write_text(json.dumps({"task": "ner", "tags": ["B-LOC", "B-PER", "O"]}))

    def run_model(*args, **kwargs):
        raise AssertionError("the model ran")

    monkeypatch.setattr(E, "run_model", run_model)
    with pytest.raises(CheckpointError, match=r"m/config\.json \(id2label\): the head's tag 'PER' is not O or a B- "
                                              r".*\(rename them\)"):  # fmt: skip
        E.evaluate_model(tmp_path / "m", str(data))
    with pytest.raises(CheckpointError, match=r"m/config\.json: the head already names its outputs"):
        E.evaluate_model(tmp_path / "m", str(data), labels_from=str(data))  # renaming PER as B-PER by position
    with pytest.raises(CheckpointError, match=r"unnamed/config\.json \(id2label\): the head's tag 'LABEL_0' .*give "
                                              r"--labels-from the data the model was trained on"):  # fmt: skip
        E.evaluate_model(tmp_path / "unnamed", str(data))
    with pytest.raises(AssertionError, match="the model ran"):  # named by the data's own tags, the head is scored
        E.evaluate_model(tmp_path / "unnamed", str(data), labels_from=str(data))


def test_labels_from_never_renames_a_named_head_by_position(tmp_path, monkeypatch):
    """A head naming [joy, anger] took --labels-from [anger, joy]: every prediction swapped, exit 0."""
    import json

    from symfuse.errors import CheckpointError

    model = save_tiny_text_classifier(tmp_path / "m", num_labels=2)
    cfg = json.loads((model / "config.json").read_text())
    cfg.update(id2label={"0": "joy", "1": "anger"}, label2id={"joy": 0, "anger": 1})
    (model / "config.json").write_text(json.dumps(cfg))
    data = toy_dataset(tmp_path / "d", labels=("anger", "joy"))

    def run_model(*args, **kwargs):
        raise AssertionError("the model ran")

    monkeypatch.setattr(E, "run_model", run_model)
    renamed = r"m/config\.json: the head already names its outputs \(joy, anger\); --labels-from .* by position \(anger"
    with pytest.raises(CheckpointError, match=renamed):
        E.evaluate_model(model, str(data), labels_from=str(data))
    same = toy_dataset(tmp_path / "same", labels=("Joy", "anger"))  # the head's names in its order: a no-op
    (same / "meta.json").write_text(json.dumps({"task": "classification", "labels": ["Joy", "anger"]}))
    with pytest.raises(AssertionError, match="the model ran"):
        E.evaluate_model(model, str(data), labels_from=str(same))


@pytest.mark.parametrize("pad", [102, None], ids=["config-pad-not-the-tokenizer-s", "no-config-pad"])
def test_a_decoder_classifier_scores_every_row_at_its_own_last_token(tmp_path, pad):
    """GPT-2's classifier reads each row at its last token that is not config.pad_token_id: batches padded with the
    tokenizer's id (0) were scored at a pad for every shorter row (loss 0.6966 at 64 rows, 0.7101 one by one); with
    no pad id in the config, transformers refused any batch of two rows."""
    import json

    import transformers as T

    from symfuse.checkpoint import resolve_checkpoint
    from tests.tiny import tiny_config

    tok = T.AutoTokenizer.from_pretrained(str(resolve_checkpoint("minilm")))  # pads with 0
    torch.manual_seed(0)
    config = tiny_config("gpt2", vocab_size=tok.vocab_size, num_labels=2, pad_token_id=pad)
    T.GPT2ForSequenceClassification(config).save_pretrained(tmp_path / "g")
    tok.save_pretrained(tmp_path / "g")
    data = toy_dataset(tmp_path / "d", labels=("LABEL_0", "LABEL_1"))
    rows = [{"text": " ".join(["word"] * (1 + 3 * i)), "label": f"LABEL_{i % 2}"} for i in range(6)]  # 6 lengths
    (data / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    one = E.evaluate_model(tmp_path / "g", str(data), batch_size=1, out_file=tmp_path / "1.json")
    six = E.evaluate_model(tmp_path / "g", str(data), batch_size=6, out_file=tmp_path / "6.json")
    assert six["loss"] == pytest.approx(one["loss"], rel=1e-5)
