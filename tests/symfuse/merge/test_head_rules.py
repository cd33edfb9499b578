"""Heads in a merge: a base with another head still merges the bodies; one naming rule; evaluate finds its head."""

import json
import re

import torch
from safetensors.torch import load_file

from symfuse.merge import merge_checkpoints
from tests.cli.helpers import run_cli, toy_dataset
from tests.tiny import save_tiny_text_classifier


def _trained(folder, seed, labels, dataset):
    save_tiny_text_classifier(folder, seed=seed, num_labels=len(labels))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["id2label"] = {str(i): lab for i, lab in enumerate(labels)}
    cfg["label2id"] = {lab: i for i, lab in enumerate(labels)}
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "symfuse_train.json").write_text(json.dumps({"dataset": dataset}))
    return folder


def test_a_base_with_another_head_merges_the_bodies(tmp_path):
    labels = [f"c{i}" for i in range(13)]
    a = _trained(tmp_path / "a", 1, labels, "d1")
    b = _trained(tmp_path / "b", 2, labels, "d2")
    base = _trained(tmp_path / "base", 0, ["x", "y", "z"], "d0")
    out = merge_checkpoints("task-arithmetic", [a, b], tmp_path / "m", base=base)
    got, wa, wb, w0 = (load_file(str(f / "model.safetensors")) for f in (out, a, b, base))
    torch.testing.assert_close(got["classifier.weight"], (wa["classifier.weight"] + wb["classifier.weight"]) / 2)
    name = "bert.encoder.layer.0.attention.self.query.weight"  # the body: base + the mean task vector
    torch.testing.assert_close(got[name], w0[name] + ((wa[name] - w0[name]) + (wb[name] - w0[name])) / 2)


def test_head_folders_are_named_after_the_dataset_and_evaluate_picks_its_head(tmp_path):
    data = toy_dataset(tmp_path / "toyset", labels=("anger", "joy"))
    a = _trained(tmp_path / "model-a", 1, ["anger", "joy"], "first")
    b = _trained(tmp_path / "model-b", 2, ["calm", "sad", "joy"], "toyset")  # another label set: heads kept apart
    out = merge_checkpoints("simple", [a, b], tmp_path / "m")
    report = json.loads((out / "symfuse_report.json").read_text())
    assert report["heads"]["folders"] == {"first": ".", "toyset": "heads/toyset"}  # without --stats too
    proc = run_cli("evaluate", out, "--data", data, "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    assert f"scoring with the head trained on toyset ({out / 'heads' / 'toyset'})" in proc.stderr


def test_a_base_of_another_model_is_refused_not_skipped(tmp_path):
    """A GPT-2 base (or MiniLM's 384-wide one) for 32-wide BERT fine-tunes: every tensor lacked a base of its shape,
    so ties / task-arithmetic / dare averaged the models with exit 0 ("no_base_averaged": 41 in the report)."""
    import pytest

    from symfuse.checkpoint import resolve_checkpoint
    from symfuse.errors import CheckpointError
    from tests.tiny import save_tiny

    a, b = (save_tiny_text_classifier(tmp_path / n, seed=s) for n, s in (("a", 1), ("b", 2)))
    gpt2 = save_tiny(tmp_path / "gpt2", "gpt2", seed=0)
    minilm = resolve_checkpoint("minilm")
    for base, line in [
        (gpt2, f"--base {gpt2}: a gpt2 model, and {a} a bert one — give the base the models were "),
        (minilm, f"--base {minilm}: embeddings.LayerNorm.bias has shape (384,), {a} (32,) — "),
    ]:
        for strategy in ("ties", "task-arithmetic"):
            with pytest.raises(CheckpointError, match=re.escape(line)):
                merge_checkpoints(strategy, [a, b], tmp_path / "m", base=base)
    assert not (tmp_path / "m").exists()
