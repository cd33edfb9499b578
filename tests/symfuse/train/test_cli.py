import json

import torch
from typer.testing import CliRunner

import symfuse.cli.evaluate
import symfuse.cli.train  # noqa: F401  (registers finetune)
from symfuse.cli import app
from tests.symfuse.train.helpers import save_tiny_base


def test_finetune_evaluate_barrier_commands(tmp_path):
    data = tmp_path / "toy"
    data.mkdir()
    rows = [
        {"text": f"i feel so {w} today", "label": lab}
        for w, lab in [("happy", "joy"), ("angry", "anger"), ("glad", "joy"), ("furious", "anger")] * 4
    ]
    for split in ("train", "validation", "test"):
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (data / "meta.json").write_text(json.dumps({"task": "classification", "labels": ["anger", "joy"]}))
    base = save_tiny_base(tmp_path / "base")
    runner = CliRunner()
    res = runner.invoke(
        app,
        [
            "finetune",
            str(base),
            "--data",
            str(data),
            "--out",
            str(tmp_path / "ft"),
            "--epochs",
            "2",
            "--lr",
            "1e-3",
            "--max-length",
            "16",
        ],
    )
    assert res.exit_code == 0, res.output
    assert "epoch 2" in res.output and (tmp_path / "ft" / "model.safetensors").exists()
    config = json.loads((tmp_path / "ft" / "config.json").read_text())
    assert config["id2label"] == {"0": "anger", "1": "joy"}
    res = runner.invoke(app, ["evaluate", str(tmp_path / "ft"), "--data", str(data), "--out", str(tmp_path / "m.json")])
    assert res.exit_code == 0, res.output
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["n"] == 16 and metrics["split"] == "test" and 0 <= metrics["macro_f1"] <= 1
    res = runner.invoke(
        app,
        [
            "barrier",
            str(tmp_path / "ft"),
            str(tmp_path / "ft"),
            "--data",
            str(data),
            "--points",
            "3",
            "--out",
            str(tmp_path / "bar"),
        ],
    )
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "bar" / "barrier.json").read_text())["barrier"] == 0.0
    # --freeze-embeddings: the token table leaves training as BASE has it
    from safetensors.torch import load_file

    res = runner.invoke(app, ["finetune", str(base), "--data", str(data), "--out", str(tmp_path / "fz"), "--epochs",
                              "1", "--lr", "1e-3", "--max-length", "16", "--freeze-embeddings"])  # fmt: skip
    assert res.exit_code == 0, res.output
    before, after = load_file(str(base / "model.safetensors")), load_file(str(tmp_path / "fz" / "model.safetensors"))
    word = next(k for k in before if k.endswith("word_embeddings.weight"))
    assert torch.equal(after[next(k for k in after if k.endswith("word_embeddings.weight"))], before[word])


def test_finetune_union_labels_writes_the_union_head(tmp_path):
    data = tmp_path / "toy"
    data.mkdir()
    rows = [{"text": f"i feel so {w} today", "label": lab} for w, lab in [("happy", "joy"), ("furious", "anger")] * 4]
    for split in ("train", "validation", "test"):
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (data / "meta.json").write_text(json.dumps({"task": "classification", "labels": ["anger", "joy"]}))
    base = save_tiny_base(tmp_path / "base")
    runner = CliRunner()
    common = ["finetune", str(base), "--data", str(data), "--out", str(tmp_path / "ft"), "--epochs", "1"]
    res = runner.invoke(app, [*common, "--union-of", f"{data},meld"])
    assert res.exit_code != 0 and "--union-of: give it exactly with --labels union" in res.output
    assert not (tmp_path / "ft").exists()
    ner = tmp_path / "ner"  # its BIO tags became sentence classes of the head, exit 0
    ner.mkdir()
    (ner / "train.jsonl").write_text(json.dumps({"tokens": ["i", "feel"], "tags": ["B-x", "O"]}) + "\n")
    res = runner.invoke(app, [*common, "--labels", "union", "--union-of", f"{data},{ner}"])
    assert res.exit_code != 0 and f"--union-of: {ner} is a ner dataset — union labels are the classes" in res.output
    assert not (tmp_path / "ft").exists()
    res = runner.invoke(app, [*common, "--labels", "union", "--union-of", f"{data},meld", "--max-length", "16"])
    assert res.exit_code == 0, res.output
    space = json.loads((tmp_path / "ft" / "config.json").read_text())["symfuse_label_space"]
    assert space["labels"] == ["anger", "joy", "disgust", "fear", "neutral", "sadness", "surprise"]
    assert space["learned"] == [True, True, False, False, False, False, False]


def test_a_head_seed_for_a_head_that_is_kept_is_said_to_draw_nothing(tmp_path, caplog):
    """The base already holds a head over the data's classes: --head-seed changed nothing, without a word."""
    from tests.cli.helpers import toy_dataset

    data = str(toy_dataset(tmp_path / "toy"))
    common = ["--data", data, "--epochs", "1", "--max-length", "16"]
    first = CliRunner().invoke(app, ["finetune", str(save_tiny_base(tmp_path / "base")), *common, "--out",
                                     str(tmp_path / "ft")])  # fmt: skip
    assert first.exit_code == 0, first.output
    again = CliRunner().invoke(app, ["finetune", str(tmp_path / "ft"), *common, "--head-seed", "3", "--out",
                                     str(tmp_path / "ft2")])  # fmt: skip
    assert again.exit_code == 0, again.output
    assert "--head-seed 3: " in caplog.text
    assert "already has a head over the data's classes, which is kept" in caplog.text
