"""A checkpoint folder must agree with itself before anything reads it: its shard index, its config against its
weights (shapes, head classes, layer count) and its tokenizer against its model."""

import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from symfuse.checkpoint import CheckpointReader, validate_checkpoint
from symfuse.data import load_tokenizer
from symfuse.errors import CheckpointError, TokenizerError
from tests.tiny import save_tiny

QUERY = "encoder.layer.0.attention.self.query.weight"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny") / "m", "bert", seed=0)


def _shard(folder, target):
    """Turn a single-file checkpoint into a one-shard index whose weight_map points at ``target``."""
    names = list(load_file(str(next(folder.glob("*.safetensors")))))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": dict.fromkeys(names, target)}))


@pytest.mark.parametrize("target", ["../outside.safetensors", "sub/../../outside.safetensors", "ABS"])
def test_shard_index_pointing_outside_the_folder_is_refused(tiny, tmp_path, target):
    outside = tmp_path / "outside.safetensors"
    shutil.copy2(tiny / "model.safetensors", outside)
    folder = shutil.copytree(tiny, tmp_path / "m")
    _shard(folder, str(outside) if target == "ABS" else target)
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="outside the checkpoint folder"):
        CheckpointReader(folder)


def test_shard_index_inside_the_folder_works_and_must_be_complete(tiny, tmp_path):
    folder = shutil.copytree(tiny, tmp_path / "m")
    os.replace(folder / "model.safetensors", folder / "model-00000.safetensors")
    _shard(folder, "model-00000.safetensors")
    with CheckpointReader(folder) as r:
        torch.testing.assert_close(r.get(QUERY), load_file(str(tiny / "model.safetensors"))[QUERY])
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["encoder.layer.0.ghost.weight"] = "model-00000.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="does not hold it"):
        CheckpointReader(folder)
    del index["weight_map"]["encoder.layer.0.ghost.weight"]
    del index["weight_map"][QUERY]  # the index loses a tensor the architecture needs
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="missing"):
        CheckpointReader(folder)


def test_a_folder_of_a_single_file_and_an_index_of_other_shards_is_refused(tiny, tmp_path):
    """Two models in one folder: symfuse read the shards, transformers model.safetensors (exit 0 both ways)."""
    folder = shutil.copytree(tiny, tmp_path / "m")
    _shard(folder, "model.safetensors")  # an index naming the single file itself describes one model: read
    with CheckpointReader(folder) as r:
        torch.testing.assert_close(r.get(QUERY), load_file(str(tiny / "model.safetensors"))[QUERY])
    other = {k: v + 1 for k, v in load_file(str(tiny / "model.safetensors")).items()}
    save_file(other, str(folder / "model-00001-of-00001.safetensors"), {"format": "pt"})
    _shard(folder, "model-00001-of-00001.safetensors")
    both = r"m: holds both model\.safetensors and a model\.safetensors\.index\.json naming other shards .* remove the"
    with pytest.raises(CheckpointError, match=both):
        CheckpointReader(folder)


def test_shapes_must_agree_with_the_config(tiny, tmp_path):
    folder = shutil.copytree(tiny, tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["intermediate_size"] = 64  # the weights say 48
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config.json implies \[64, 32\]"):
        CheckpointReader(folder)


@pytest.mark.parametrize(("family", "head"), [("bert", "seq"), ("roberta", "seq"), ("gpt2", "seq"), ("llama", "token")])
def test_a_head_of_other_classes_than_the_config_names_is_refused(family, head, tmp_path):
    folder = save_tiny(tmp_path / "m", family, head=head)  # 3 classes
    with CheckpointReader(folder) as r:
        assert r.config.num_labels == 3
    cfg = json.loads((folder / "config.json").read_text())
    cfg["id2label"] = {str(i): f"c{i}" for i in range(4)}  # the labels edited, the head left at 3 outputs
    cfg["label2id"] = {f"c{i}": i for i in range(4)}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json: 4 classes \(num_labels / id2label\) but no tensor of "
                                              r"the \w+For\w+Classification head has 4 outputs \(.*\[3"):  # fmt: skip
        CheckpointReader(folder)


def test_every_family_opens_with_its_stored_layer_count(tmp_path):
    from tests.tiny import FAMILIES

    for family in FAMILIES:
        with CheckpointReader(save_tiny(tmp_path / family, family)) as r:
            assert r.spec.modules(r.config)


@pytest.mark.parametrize(
    ("family", "key"),
    [("bert", "num_hidden_layers"), ("gpt2", "n_layer"), ("llama", "num_hidden_layers"), ("t5", "num_decoder_layers"),
     ("clip", "text_config.num_hidden_layers")],
)  # fmt: skip
def test_a_config_of_fewer_layers_than_the_weights_is_refused(family, key, tmp_path):
    from symfuse.match import disguise_checkpoint

    folder = save_tiny(tmp_path / "m", family)
    cfg = json.loads((folder / "config.json").read_text())
    holder, _, field = key.rpartition(".")
    sub = cfg[holder] if holder else cfg
    sub[field] -= 1  # the last stored layer is no longer part of the model the config describes
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=rf"config\.json: {key} is {sub[field]} but the weights hold layer "
                                              rf"{sub[field]} \("):  # fmt: skip
        CheckpointReader(folder)
    with pytest.raises(CheckpointError, match="do not belong together"):  # it was copied through untransformed
        disguise_checkpoint(folder, tmp_path / "out", seed=0)
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_that_cannot_feed_the_models_embeddings_is_refused(tmp_path):
    """Another model's tokenizer failed the first batch holding a large id: 'internal error: IndexError'."""
    import transformers as T

    from tests.tiny import save_tiny_text_classifier

    folder = save_tiny_text_classifier(tmp_path / "m")  # MiniLM's 30522-token tokenizer, 30522 embeddings
    assert len(load_tokenizer(folder)) == 30522
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "vocab_size": 30000}))
    embeds = r"m: the tokenizer has 30522 tokens but the model embeds 30000 \(config\.json vocab_size\), so it belongs"
    with pytest.raises(TokenizerError, match=embeds):
        load_tokenizer(folder)
    (folder / "config.json").write_text(json.dumps(cfg))
    tok = T.AutoTokenizer.from_pretrained(str(folder))
    tok.add_special_tokens({"pad_token": "[NEWPAD]"})  # added without resizing the embeddings
    tok.save_pretrained(str(folder))
    with pytest.raises(TokenizerError, match=r"m: the tokenizer pads with token id 30522, past the model's 30522 "):
        load_tokenizer(folder)


def test_missing_or_toy_tokenizer_is_refused(tiny, tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer files"):
        load_tokenizer(tiny)
    with pytest.raises(TokenizerError, match="no tokenizer files"):
        validate_checkpoint(tiny, tokenizer=True)
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[PAD]": 1, "[CLS]": 2, "[SEP]": 3, "a": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    folder = shutil.copytree(tiny, tmp_path / "toy")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]").save_pretrained(folder)
    with pytest.raises(TokenizerError, match="only 5 tokens"):
        load_tokenizer(folder)
    (folder / "tokenizer.json").write_text("{not json")  # cut or garbled: transformers' own error named no file
    for check in (load_tokenizer, lambda f: validate_checkpoint(f, tokenizer=True)):
        with pytest.raises(TokenizerError, match=r"toy/tokenizer\.json: cannot be read as JSON \(Expecting"):
            check(folder)


def test_an_untied_lm_head_must_be_stored(tmp_path):
    """transformers drew a missing untied lm_head at random on each load; match "verified" its result against one."""
    untied = save_tiny(tmp_path / "u", "llama", seed=1, head="lm", tie_word_embeddings=False)
    weights = load_file(str(untied / "model.safetensors"))
    del weights["lm_head.weight"]
    save_file(weights, str(untied / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"lm_head\.weight is missing while config\.json unties it"):
        validate_checkpoint(untied)
    tied = save_tiny(tmp_path / "t", "llama", seed=1, head="lm", tie_word_embeddings=True)  # stored once: fine
    assert "lm_head.weight" not in load_file(str(tied / "model.safetensors"))
    assert validate_checkpoint(tied) == tied


@pytest.mark.parametrize(
    ("id2label", "says"),
    [
        ({"0": "anger", "1": "joy", "3": "fear"}, "numbers its outputs 0, 1, 3, not 0..2"),  # evaluate: KeyError 2
        ({"-1": "anger", "0": "joy", "1": "fear"}, "numbers its outputs -1, 0, 1"),
        ({"0": "anger", "a": "joy", "2": "fear"}, "has the key 'a'"),  # evaluate: "invalid literal for int()"
        (["anger", "joy", "fear"], "is a JSON list"),
        ({"0": "anger", "1": "Anger", "2": "fear"}, "names 'anger' twice (outputs 0 and 1)"),  # evaluate: exit 0
    ],
)
def test_a_head_whose_id2label_misnumbers_or_renames_its_outputs_is_refused(tmp_path, id2label, says):
    from tests.cli.helpers import run_cli, toy_dataset
    from tests.tiny import save_tiny_text_classifier

    folder = save_tiny_text_classifier(tmp_path / "m", num_labels=3)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "id2label": id2label}))
    with pytest.raises(CheckpointError, match=re.escape(f"config.json: id2label {says}")):
        CheckpointReader(folder)
    data = toy_dataset(tmp_path / "d", ("anger", "joy", "fear"))
    r = run_cli("evaluate", folder, "--data", data, "--out", tmp_path / "e.json")
    assert r.returncode == 1 and f"{folder}/config.json: id2label" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "e.json").exists()


def test_a_head_named_in_order_passes_its_id2label_check(tmp_path):
    from tests.tiny import save_tiny_text_classifier

    folder = save_tiny_text_classifier(tmp_path / "m", num_labels=3)
    assert CheckpointReader(folder).config.num_labels == 3
