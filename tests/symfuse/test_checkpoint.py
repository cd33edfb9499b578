"""Checkpoint loading: concurrent loads must not leave transformers' global patches behind."""

from concurrent.futures import ThreadPoolExecutor

import huggingface_hub
import pytest
import torch
import transformers

from symfuse.checkpoint import load_hf_model, resolve_checkpoint
from symfuse.errors import CheckpointError
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


def test_a_misspelt_or_unsupported_model_type_is_one_line_naming_config_json(tmp_path):
    import json

    import pytest

    from symfuse.checkpoint import CheckpointReader
    from symfuse.errors import UnsupportedArchitecture

    folder = save_tiny(tmp_path / "m", "bert")
    config = json.loads((folder / "config.json").read_text())
    for model_type, hint in [("bret", "did you mean 'bert'? "), ("bart", "")]:  # unknown anywhere / to symfuse only
        (folder / "config.json").write_text(json.dumps(config | {"model_type": model_type}))
        with pytest.raises(UnsupportedArchitecture) as info:
            CheckpointReader(folder)
        msg = str(info.value)
        assert "\n" not in msg and msg.startswith(f"{folder}/config.json: model_type {model_type!r} is not an "), msg
        assert f"— {hint}fix model_type, or use a model of a known family (albert, bert, " in msg, msg
    (folder / "config.json").write_text('{"model_type": "bert",\n "hidden_size": }')
    with pytest.raises(ValueError, match=r"config\.json:2:17: not valid JSON \(Expecting value\)"):
        CheckpointReader(folder)


def test_a_hub_id_offline_is_one_line_and_the_hf_prefix_names_the_same_id(monkeypatch):
    asked = []

    def offline(repo, **kw):
        asked.append(repo)
        raise huggingface_hub.errors.LocalEntryNotFoundError("cannot find the requested files in the disk cache")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    for given in ("someorg/some-model", "hf:someorg/some-model"):
        with pytest.raises(CheckpointError) as info:
            resolve_checkpoint(given)
        assert str(info.value) == (
            f"{given}: not a local folder, and hub downloads are off here (HF_HUB_OFFLINE) and the hub cache does not "
            "hold it; pass a local save_pretrained folder"
        )
    assert asked == ["someorg/some-model", "someorg/some-model"]  # 'hf:' was a repo-id error from the hub client


def test_a_model_folder_with_a_stray_adapter_config_is_refused(tmp_path):
    """transformers loads such a folder as a PEFT adapter: stats failed on a missing adapter_model.safetensors."""
    folder = save_tiny(tmp_path / "m", "bert")
    assert resolve_checkpoint(folder) == folder
    (folder / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8, "base_model_name_or_path": "x"}')
    stray = r"m: holds adapter_config\.json beside config\.json, so transformers loads it as a PEFT adapter — remove"
    with pytest.raises(CheckpointError, match=stray):
        resolve_checkpoint(folder)
    with pytest.raises(OSError, match="adapter_model"):  # what transformers makes of it
        transformers.AutoModel.from_pretrained(str(folder))


def test_a_model_that_reads_pixels_is_named_so_where_text_is_read(tmp_path):
    """finetune of a ViT said to copy a tokenizer in; with one, transformers failed naming no file."""
    from symfuse.checkpoint import validate_checkpoint
    from symfuse.errors import CheckpointError
    from tests.tiny import save_tiny

    vit = save_tiny(tmp_path / "vit", "vit", head="seq")
    with pytest.raises(CheckpointError, match=r"vit: a vit model reads pixels, not text — symfuse reads text data"):
        validate_checkpoint(vit, tokenizer=True)
    assert validate_checkpoint(vit) == vit.resolve()
