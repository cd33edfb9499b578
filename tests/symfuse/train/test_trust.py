"""stats / evaluate / finetune refuse NaN weights and missing tokenizers; finetune stops at a non-finite loss."""

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import symfuse.cli.evaluate
import symfuse.cli.stats
import symfuse.cli.train  # noqa: F401  (registers the commands)
from symfuse.cli import app
from symfuse.errors import NonFiniteError, TokenizerError
from symfuse.evaluate import evaluate_model, loss_barrier
from symfuse.match.activation import match_activation_checkpoints
from symfuse.stats import collect_stats
from symfuse.train import FinetuneConfig, finetune
from tests.symfuse.train.helpers import TOKENIZER_FILES, save_tiny_base

NAME = "encoder.layer.1.attention.output.dense.weight"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("trust")
    data = root / "toy"
    data.mkdir()
    rows = [
        {"text": f"i feel so {w} today", "label": lab}
        for w, lab in [("happy", "joy"), ("angry", "anger"), ("glad", "joy"), ("furious", "anger")] * 3
    ]
    for split in ("train", "validation", "test"):
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (data / "meta.json").write_text(json.dumps({"task": "classification", "labels": ["anger", "joy"]}))
    base = save_tiny_base(root / "base")
    cfg = FinetuneConfig(epochs=1, batch_size=4, max_length=16, progress=False)
    tuned = finetune(base, str(data), root / "tuned", cfg)
    return data, base, tuned


def _nan_copy(src, dst, name=NAME):
    shutil.copytree(src, dst)
    sd = load_file(str(dst / "model.safetensors"))
    key = next(k for k in sd if k.endswith(name))
    sd[key].view(-1)[7] = float("nan")
    save_file(sd, str(dst / "model.safetensors"), {"format": "pt"})
    return dst, key


def _no_tokenizer(src, dst):
    shutil.copytree(src, dst)
    for f in TOKENIZER_FILES:
        (dst / f).unlink(missing_ok=True)
    return dst


def _cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_nan_weights_are_refused_by_stats_evaluate_and_finetune(setup, tmp_path):
    data, base, tuned = setup
    bad_base, key = _nan_copy(base, tmp_path / "bad_base")
    bad_tuned, key2 = _nan_copy(tuned, tmp_path / "bad_tuned")
    with pytest.raises(NonFiniteError) as err:
        finetune(bad_base, str(data), tmp_path / "ft", FinetuneConfig(epochs=1, batch_size=4, progress=False))
    assert key in str(err.value) and str(bad_base / "model.safetensors") in str(err.value)
    with pytest.raises(NonFiniteError, match=key2):
        evaluate_model(bad_tuned, str(data), split="test")
    with pytest.raises(NonFiniteError, match=key2):
        collect_stats(bad_tuned, str(data), ["gram"], tmp_path / "st", progress=False)
    assert not (tmp_path / "ft").exists() and not (tmp_path / "st").exists()
    assert not list(bad_tuned.glob("eval_*.json"))
    res = _cli("stats", bad_tuned, "--data", data, "--out", tmp_path / "st2")
    assert res.exit_code != 0 and not (tmp_path / "st2").exists()


def test_missing_tokenizer_is_refused_by_stats_evaluate_and_finetune(setup, tmp_path):
    data, base, tuned = setup
    bare_base, bare_tuned = _no_tokenizer(base, tmp_path / "bb"), _no_tokenizer(tuned, tmp_path / "bt")
    with pytest.raises(TokenizerError, match="no tokenizer files") as err:
        finetune(bare_base, str(data), tmp_path / "ft", FinetuneConfig(epochs=1, batch_size=4, progress=False))
    assert str(bare_base) in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(TokenizerError, match="no tokenizer files"):
        evaluate_model(bare_tuned, str(data), split="test")
    with pytest.raises(TokenizerError, match="no tokenizer files"):
        collect_stats(bare_tuned, str(data), ["gram"], tmp_path / "st", progress=False)
    assert not (tmp_path / "ft").exists() and not (tmp_path / "st").exists()
    res = _cli("evaluate", bare_tuned, "--data", data, "--split", "test")
    assert res.exit_code != 0
    with pytest.raises(TokenizerError, match="no tokenizer files"):
        match_activation_checkpoints(bare_base, base, tmp_path / "m", str(data), max_examples=8)
    with pytest.raises(TokenizerError, match="no tokenizer files"):
        loss_barrier(bare_tuned, tuned, str(data), tmp_path / "b", points=3)
    assert not (tmp_path / "m").exists() and not (tmp_path / "b").exists()


def test_finetune_stops_at_the_first_non_finite_loss_and_writes_nothing(setup, tmp_path):
    data, base, _ = setup
    cfg = FinetuneConfig(epochs=2, batch_size=4, max_length=16, warmup_ratio=0.0, progress=False)
    cfg = cfg.model_copy(update={"lr": 1e30})  # past the config's bound (lr <= 1): the divergence guard's case
    with pytest.raises(NonFiniteError, match="training loss") as err:
        finetune(base, str(data), tmp_path / "ft", cfg)
    assert "epoch 1" in str(err.value) and "\n" not in str(err.value)
    assert not list(tmp_path.iterdir())  # no output, no temporary folder


def test_finetune_refuses_weights_whose_validation_loss_is_not_finite(setup, tmp_path):
    data, base, _ = setup  # one step per epoch: its update diverges after the training loss was read
    cfg = FinetuneConfig(epochs=1, batch_size=512, max_length=16, warmup_ratio=0.0, progress=False)
    cfg = cfg.model_copy(update={"lr": 1e30})  # past the config's bound (lr <= 1): the divergence guard's case
    with pytest.raises(NonFiniteError, match=r"(validation|held-out) loss on \w+ became nan after epoch 1 — nothing "):
        finetune(base, str(data), tmp_path / "ft", cfg)
    assert not list(tmp_path.iterdir())  # it wrote val_loss NaN, marked best, and a checkpoint of NaN weights
