"""Adapters of an ``lm_head`` or the embedding: PEFT saves the layer's base weight beside the factors; ties."""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers as T
from safetensors.torch import load_file, save_file

from symfuse.errors import CheckpointError, UsageError
from symfuse.lora import merge_adapters
from tests.symfuse.lora.helpers import effective_weights, make_adapter, worst
from tests.tiny import save_tiny

COPY = "base_model.model.lm_head.base_layer.weight"


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def head_adapter(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("head")
    base = save_tiny(d / "base", "llama", head="lm", tie_word_embeddings=request.param)
    adapter = make_adapter(base, d / "ad", seed=5, targets=["q_proj", "lm_head"])
    assert COPY in load_file(str(adapter / "adapter_model.safetensors"))  # what PEFT saves for an adapted lm_head
    return base, adapter


def _loaded(folder, adapter=None):
    return effective_weights(folder, adapter)


def test_an_lm_head_adapter_goes_into_the_base_as_peft_merges_it(head_adapter, tmp_path):
    # it was refused for its saved base-layer copy; a tied head was "not in the base" (stored as the embedding)
    base, adapter = head_adapter
    want = effective_weights(base, adapter)
    assert not torch.equal(want["lm_head.weight"], effective_weights(base, None)["lm_head.weight"])
    out = merge_adapters([adapter], tmp_path / "out", "simple", base=base, into_base=True)
    assert worst(_loaded(out), want) < 1e-6


def test_an_lm_head_adapter_merges_into_an_adapter_peft_applies_the_same(head_adapter, tmp_path):
    base, adapter = head_adapter
    out = merge_adapters([adapter, adapter], tmp_path / "out", "simple", base=base)
    assert COPY not in load_file(str(out / "adapter_model.safetensors"))  # the base holds it
    assert worst(_loaded(base, out), effective_weights(base, adapter)) < 1e-6


def test_a_saved_copy_is_not_taken_unchecked_without_the_base(head_adapter, tmp_path):
    _, adapter = head_adapter
    text = r"ad/adapter_model\.safetensors: holds .*lm_head\.base_layer\.weight, a copy of the base's lm_head\.weight"
    with pytest.raises(UsageError, match=text + r" .* give the base with --base BASE"):
        merge_adapters([adapter], tmp_path / "out", "simple")
    assert not (tmp_path / "out").exists()


def test_a_saved_copy_other_than_the_base_weight_is_refused(head_adapter, tmp_path):
    # PEFT loads the copy over the base's head (a trained or resized vocabulary): a merge onto the base is not PEFT's
    base, adapter = head_adapter
    other = shutil.copytree(adapter, tmp_path / "other")
    file = other / "adapter_model.safetensors"
    tensors = load_file(str(file))
    tensors[COPY] = tensors[COPY] + 1e-3
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"other/adapter_model\.safetensors: holds .*, which PEFT loads over the "
                                              r"base's lm_head\.weight, but it is not .*base's"):  # fmt: skip
        merge_adapters([adapter, other], tmp_path / "out", "simple", base=base, into_base=True)
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def embedding_adapters(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("emb")
    base = save_tiny(d / "base", "llama", head="lm", tie_word_embeddings=request.param)
    made = [make_adapter(base, d / f"ad{i}", seed=i, targets=["q_proj", "embed_tokens"]) for i in (1, 2)]
    assert any("lora_embedding_A" in k for k in load_file(str(made[0] / "adapter_model.safetensors")))
    return base, made


def test_an_embedding_adapter_merges_as_peft_merges_it(embedding_adapters, tmp_path):
    # it was refused ("an embedding LoRA — not supported"); PEFT adds (B A)^T to the (vocab, dim) weight
    base, (a, b) = embedding_adapters
    one = merge_adapters([a], tmp_path / "one", "simple", base=base, into_base=True)
    assert worst(_loaded(one), effective_weights(base, a)) < 1e-6
    model = merge_adapters([a, b], tmp_path / "model", "ties", base=base, into_base=True, density=0.5)
    adapter = merge_adapters([a, b], tmp_path / "adapter", "ties", base=base, density=0.5)
    stored = load_file(str(adapter / "adapter_model.safetensors"))
    assert "base_model.model.model.embed_tokens.lora_embedding_A" in stored
    assert worst(_loaded(base, adapter), _loaded(model)) < 1e-6
    assert not torch.equal(_loaded(model)["model.embed_tokens.weight"], _loaded(base)["model.embed_tokens.weight"])


def test_a_dora_embedding_is_refused(tmp_path):
    base = save_tiny(tmp_path / "base", "llama", head="lm")
    dora = make_adapter(base, tmp_path / "dora", seed=1, targets=["q_proj", "embed_tokens"], use_dora=True)
    with pytest.raises(CheckpointError, match=r"model\.embed_tokens is a DoRA embedding — not supported"):
        merge_adapters([dora], tmp_path / "out", "simple", base=base, into_base=True)


def test_a_tied_head_and_its_embedding_both_adapted_take_both_updates(tmp_path):
    """One stored tensor, two adapted modules: the second update written replaced the first (1.6 off PEFT's)."""
    base = save_tiny(tmp_path / "base", "llama", head="lm", tie_word_embeddings=True)
    both = make_adapter(base, tmp_path / "both", seed=1, targets=["embed_tokens", "lm_head"])
    one = merge_adapters([both], tmp_path / "one", "simple", base=base, into_base=True)
    assert worst(_loaded(one), effective_weights(base, both)) < 1e-6
    emb, head = (make_adapter(base, tmp_path / t, seed=2, targets=[t]) for t in ("embed_tokens", "lm_head"))
    model = merge_adapters([emb, head], tmp_path / "model", "task-arithmetic", base=base, into_base=True, lam=1.0)
    adapter = merge_adapters([emb, head], tmp_path / "adapter", "task-arithmetic", base=base, lam=1.0)
    assert worst(_loaded(model), _loaded(base, adapter)) < 1e-6


@pytest.mark.parametrize(
    ("family", "output"), [("bert", "decoder"), ("roberta", "decoder"), ("electra", "generator_lm_head"),
                           ("albert", "decoder")],
)  # fmt: skip
def test_a_masked_lm_decoder_tied_to_the_embedding_takes_its_update_there(family, output, tmp_path):
    """cls.predictions.decoder / lm_head.decoder are stored as the embedding: 'has no ...decoder.weight', refused."""
    auto = T.AutoModelForMaskedLM
    base = save_tiny(tmp_path / "base", family, head="mlm")
    adapter = make_adapter(base, tmp_path / "ad", seed=1, targets=["word_embeddings", output], auto=auto)
    out = merge_adapters([adapter], tmp_path / "out", "simple", base=base, into_base=True)
    got = {k: v.detach().double() for k, v in auto.from_pretrained(str(out)).state_dict().items()}
    assert worst(got, effective_weights(base, adapter, auto)) < 1e-6


def test_a_whole_trained_embedding_of_a_tied_base_is_said_to_become_the_output_layer_too(tmp_path, caplog):
    base = save_tiny(tmp_path / "base", "llama", head="lm", tie_word_embeddings=True)
    adapter = make_adapter(base, tmp_path / "ad", seed=1, targets=["q_proj"], modules_to_save=["embed_tokens"])
    merge_adapters([adapter], tmp_path / "out", "simple", base=base, into_base=True)
    assert "trains model.embed_tokens.weight whole, which the base ties to another layer" in caplog.text


def test_t5_embeddings_tied_to_shared_take_both_updates(tmp_path):
    """encoder / decoder.embed_tokens are stored as shared.weight: 'has no decoder.embed_tokens.weight', refused."""
    auto = T.AutoModelForSeq2SeqLM
    base = save_tiny(tmp_path / "base", "t5", head="lm")
    adapter = make_adapter(base, tmp_path / "ad", seed=1, targets=["embed_tokens", "q"], auto=auto)
    out = merge_adapters([adapter], tmp_path / "out", "simple", base=base, into_base=True)
    assert worst(effective_weights(out, None, auto), effective_weights(base, adapter, auto)) < 1e-6
