"""Two models compared along a path, or merged, must read text as the same token ids."""

import json
import random
import shutil

import pytest

from symfuse.data.vocab import vocabulary_difference
from symfuse.errors import TokenizerError
from symfuse.merge import merge_checkpoints
from tests.cli.helpers import run_cli, toy_dataset
from tests.tiny import save_tiny_text_classifier


def _shuffled(model, out):
    """``model`` with its tokenizer's word pieces given each other's ids (same weights, other text -> ids)."""
    out = shutil.copytree(model, out)
    tok = json.loads((out / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    words = [w for w in vocab if not w.startswith("[")]
    ids = [vocab[w] for w in words]
    random.Random(0).shuffle(ids)
    vocab.update(zip(words, ids, strict=True))
    (out / "tokenizer.json").write_text(json.dumps(tok))
    (out / "vocab.txt").unlink(missing_ok=True)  # the slow tokenizer's copy would contradict it
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab")
    a = save_tiny_text_classifier(root / "A", seed=0)
    b = save_tiny_text_classifier(root / "B", seed=1)
    return a, b, _shuffled(a, root / "A_shuffled"), toy_dataset(root / "d")


def test_fine_tunes_of_one_base_share_a_vocabulary_and_a_resaved_config_does_not_matter(models, tmp_path):
    a, b, _, _ = models
    assert vocabulary_difference(a, b) is None  # byte-identical tokenizer files
    other = shutil.copytree(a, tmp_path / "A_resaved")
    config = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 77}))
    (other / "tokenizer.json").write_text(json.dumps(json.loads((a / "tokenizer.json").read_text()), indent=1))
    assert vocabulary_difference(a, other) is None  # other bytes, one vocabulary


def test_a_model_reading_other_token_ids_is_refused_by_barrier_inspect_and_merge(models, tmp_path):
    # barrier encoded the data with A's tokenizer only: a flat path and 'same-basin' between two different models
    a, _, shuffled, data = models
    assert "tokens have other ids" in vocabulary_difference(a, shuffled)
    r = run_cli("barrier", a, shuffled, "--data", data, "--points", "2", "--out", tmp_path / "bar")
    assert r.returncode == 1 and f"{shuffled}: its tokenizer is not {a}'s" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "bar").exists()
    r = run_cli("inspect", a, shuffled, "--data", data, "--max-examples", "4")
    assert r.returncode == 1 and "its tokenizer is not" in r.stderr
    with pytest.raises(TokenizerError, match="a merged model reads text with the first model's tokenizer"):
        merge_checkpoints("simple", [a, shuffled], tmp_path / "merged")
    assert not (tmp_path / "merged").exists()


def test_models_reading_other_token_ids_are_refused_by_match_and_match_many(models, tmp_path):
    """Matching pairs embedding rows by id and feeds both models one tokenizer's ids: it ran without a word."""
    a, _, shuffled, _ = models
    for cmd in (["match", shuffled, a], ["match-many", a, shuffled]):
        r = run_cli(*cmd, "--out", tmp_path / cmd[0], "--device", "cpu")
        assert r.returncode == 1 and f"{shuffled}: its tokenizer is not {a}'s" in r.stderr, r.stderr
        assert "matching pairs the models' embedding rows" in r.stderr and not (tmp_path / cmd[0]).exists()
