"""Checkpoint loading: concurrent loads must not leave transformers' global patches behind."""

from concurrent.futures import ThreadPoolExecutor

import torch
import transformers

from symfuse.checkpoint import load_hf_model
from tests.tiny import save_tiny, tiny_model


def test_concurrent_loads_keep_weight_tying_and_init(tmp_path):
    folder = save_tiny(tmp_path / "m", "bert", head="mlm")
    tie, init = transformers.PreTrainedModel.tie_weights, transformers.PreTrainedModel.init_weights
    with ThreadPoolExecutor(8) as pool:
        models = list(pool.map(lambda _: load_hf_model(folder), range(16)))
    # transformers swaps these class attributes while loading; racing loads used to leave the stand-ins behind
    assert transformers.PreTrainedModel.tie_weights is tie
    assert transformers.PreTrainedModel.init_weights is init
    for m in models:
        assert not m.training
        assert m.get_output_embeddings().weight.data_ptr() == m.get_input_embeddings().weight.data_ptr()
    fresh = tiny_model("bert", head="mlm")
    assert torch.equal(fresh.get_output_embeddings().weight, fresh.get_input_embeddings().weight)


def test_load_uses_the_class_named_in_the_config(tmp_path):
    folder = save_tiny(tmp_path / "m", "gpt2", head="lm")
    assert type(load_hf_model(folder)).__name__ == "GPT2LMHeadModel"
    model, info = load_hf_model(folder, transformers.AutoModel, output_loading_info=True)
    assert type(model).__name__ == "GPT2Model" and not model.training and "missing_keys" in info
