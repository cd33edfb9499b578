"""``symfuse disguise --kinds``: the residual permutation round-trips through the command line."""

import json

import pytest
import torch
import transformers as T
from safetensors.torch import load_file
from typer.testing import CliRunner

import symfuse.cli.commands  # noqa: F401  (registers the commands)
from symfuse.cli import app
from tests.cli.helpers import toy_dataset
from tests.tiny import save_tiny


def _run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def _logits(folder, ids):
    model = T.AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits.double()


VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "i", "feel", "so", "happy", "angry", "today"]
VOCAB += [f"w{i}" for i in range(256 - len(VOCAB))]  # MIN_VOCAB: the model gets 256 embeddings


@pytest.fixture
def disguised(tmp_path):
    src = save_tiny(tmp_path / "src", "bert", seed=1, head="seq", vocab_size=len(VOCAB))
    (src / "vocab.txt").write_text("\n".join(VOCAB) + "\n")  # a word-level tokenizer for the toy dataset
    r = _run("disguise", src, "--out", tmp_path / "d", "--seed", 5, "--kinds", "residual-permutation")
    assert r.exit_code == 0, r.output
    return src, tmp_path / "d"


def test_residual_permutation_keeps_the_function_and_moves_the_weights(disguised):
    src, d = disguised
    ids = torch.randint(0, 64, (3, 12), generator=torch.Generator().manual_seed(0))
    assert (_logits(src, ids) - _logits(d, ids)).abs().max() <= 1e-4
    a, b = load_file(src / "model.safetensors"), load_file(d / "model.safetensors")
    emb = next(k for k in a if k.endswith("word_embeddings.weight"))
    perm = load_file(d / "residual_permutation.safetensors")["perm"]
    assert not torch.equal(perm, torch.arange(perm.numel()))
    assert torch.equal(b[emb], a[emb][:, perm])  # new coordinate j = old perm[j]
    assert json.loads((d / "symfuse_report.json").read_text())["kinds"] == ["residual-permutation"]


def test_match_from_activations_recovers_the_residual_permutation(disguised, tmp_path):
    src, d = disguised
    data = toy_dataset(tmp_path / "toy")
    out = tmp_path / "m"
    r = _run("match", d, src, "--out", out, "--symmetries", "residual-permutation", "--data", data)
    assert r.exit_code == 0, r.output
    report = json.loads((out / "symfuse_report.json").read_text())
    assert report["max_abs_logit_diff"] <= 1e-4
    assert report["distance_before"] > 1 and report["distance_after"] < 1e-4, report


@pytest.mark.parametrize("kinds", ["bogus", ",", "rotation,rotation"])
def test_bad_kinds_are_refused(tmp_path, kinds):
    src = save_tiny(tmp_path / "src", "bert", seed=1)
    r = _run("disguise", src, "--out", tmp_path / "d", "--kinds", kinds)
    assert r.exit_code == 2 and "--kinds" in r.output, r.output
    assert not (tmp_path / "d").exists()
