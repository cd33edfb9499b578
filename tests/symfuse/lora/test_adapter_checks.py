"""Adapters PEFT applies per layer type, configs that cannot be applied, updates that overflow."""

from __future__ import annotations

import json
import math
import re
import shutil

import pytest
import torch
import transformers as T

from symfuse.errors import CheckpointError, UsageError
from symfuse.lora import merge_adapters
from tests.symfuse.lora.helpers import edited_copy, effective_weights, make_adapter, tiny_base
from tests.tiny import save_tiny


def _merged_into_base(adapter, base, out, auto):
    merge_adapters([adapter], out, "simple", base=base, into_base=True)
    return {k: v.double() for k, v in auto.from_pretrained(str(out)).state_dict().items()}


def _worst(got, want, base):
    changed = [k for k in want if not torch.equal(want[k], base[k])]
    assert changed
    return max(float((got[k] - want[k]).abs().max() / want[k].abs().max()) for k in changed), changed


def test_a_gpt2_adapter_of_conv1d_and_linear_layers_goes_into_the_base_as_peft_merges_it(tmp_path):
    # PEFT sets fan_in_fan_out per layer (on for Conv1D, off for the nn.Linear score) and saves the last value (off)
    auto = T.AutoModelForSequenceClassification
    base = save_tiny(tmp_path / "gpt2", "gpt2", head="seq")
    adapter = make_adapter(base, tmp_path / "ad", seed=1, targets=["attn.c_proj", "score"], auto=auto)
    assert json.loads((adapter / "adapter_config.json").read_text())["fan_in_fan_out"] is False
    got = _merged_into_base(adapter, base, tmp_path / "out", auto)
    worst, changed = _worst(got, effective_weights(base, adapter, auto), effective_weights(base, None, auto))
    assert {k.rsplit(".", 2)[-2] for k in changed} == {"c_proj", "score"}
    assert worst < 1e-6  # attn.c_proj is square: taken untransposed, it was off by the size of the update


def test_a_config_fan_in_fan_out_on_linear_layers_is_ignored_as_peft_ignores_it(tmp_path):
    base = tiny_base(tmp_path / "llama")
    made = make_adapter(base, tmp_path / "made", seed=2, targets=["q_proj", "o_proj"])
    adapter = edited_copy(made, tmp_path / "ad", fan_in_fan_out=True)
    got = _merged_into_base(adapter, base, tmp_path / "out", T.AutoModelForCausalLM)
    worst, _ = _worst(got, effective_weights(base, adapter), effective_weights(base, None))
    assert worst < 1e-6


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    d = tmp_path_factory.mktemp("checks")
    base = tiny_base(d / "base")
    return base, make_adapter(base, d / "ad", seed=3)


@pytest.mark.parametrize(
    ("change", "text"),
    [
        ({"lora_alpha": math.nan}, "lora_alpha is nan — it must be a positive finite number"),
        ({"lora_alpha": math.inf}, "lora_alpha is inf — it must be a positive finite number"),
        ({"r": True}, "r is True — it must be a positive whole number"),
        ({"alpha_pattern": {"q_proj": None}}, "alpha_pattern['q_proj'] is None — it must be a positive finite"),
        ({"alpha_pattern": {"q_proj": "abc"}}, "alpha_pattern['q_proj'] is 'abc'"),
        ({"alpha_pattern": {"q_proj": -3}}, "alpha_pattern['q_proj'] is -3"),
        ({"rank_pattern": {"q_proj": "4"}}, "rank_pattern['q_proj'] is '4' — it must be a positive whole number"),
        ({"rank_pattern": {"[": 4}}, "rank_pattern key '[' is not a regular expression"),
        ({"target_modules": 5}, "target_modules is 5 — it must be a module-name pattern or a list of module names"),
        ({"target_modules": ["q_proj", 7]}, "target_modules is ['q_proj', 7]"),
        # PEFT takes the string "false" as true; an unknown task_type was merged with exit 0 and PEFT refused the output
        ({"use_rslora": "false"}, "use_rslora is 'false', not true or false — write it as a JSON boolean"),
        ({"use_dora": "false"}, "use_dora is 'false', not true or false"),
        ({"task_type": "FOO"}, "task_type 'FOO' is not one PEFT loads — give one of SEQ_CLS, SEQ_2_SEQ_LM, CAUSAL_LM"),
        # the adapter's layer 0 is not among those listed: merged with exit 0, and PEFT refused the output
        ({"layers_to_transform": [5]}, "layers_to_transform is [5], but the adapter holds model.layers.0."),
        ({"layers_to_transform": ["0"]}, "layers_to_transform is ['0'] — it must be a layer index or a list of them"),
    ],
)
def test_a_config_value_peft_cannot_apply_is_refused_naming_it(adapter, change, text, tmp_path):
    base, src = adapter
    bad = edited_copy(src, tmp_path / "bad", **change)
    with pytest.raises(CheckpointError, match=rf"bad/adapter_config\.json: {re.escape(text)}"):
        merge_adapters([bad], tmp_path / "out", "simple", base=base, into_base=True)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("text", "kind"), [('["LORA"]', "array"), ('"LORA"', "string"), ("null", "null")])
def test_a_config_that_is_not_a_json_object_is_named_as_such(adapter, text, kind, tmp_path):
    # a list was reported as "peft_type is None", which sent the user looking for a missing key
    bad = shutil.copytree(adapter[1], tmp_path / "bad")
    (bad / "adapter_config.json").write_text(text)
    with pytest.raises(CheckpointError, match=rf"bad/adapter_config\.json: holds a JSON {kind}, not an object"):
        merge_adapters([bad], tmp_path / "out", "simple", base=adapter[0], into_base=True)


def test_an_adapter_of_some_layers_merges_as_peft_applies_it(adapter, tmp_path):
    base, _ = adapter
    made = make_adapter(base, tmp_path / "ad", seed=4, layers_to_transform=[1])
    got = _merged_into_base(made, base, tmp_path / "out", T.AutoModelForCausalLM)
    worst, changed = _worst(got, effective_weights(base, made), effective_weights(base, None))
    assert worst < 1e-6 and all(".layers.1." in k for k in changed)


def test_a_cut_weights_file_is_named(adapter, tmp_path):
    _, src = adapter
    cut = shutil.copytree(src, tmp_path / "cut")
    file = cut / "adapter_model.safetensors"
    file.write_bytes(file.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"cut/adapter_model\.safetensors: "):
        merge_adapters([cut], tmp_path / "out", "simple")


@pytest.mark.parametrize("into_base", [True, False])
def test_an_update_that_overflows_its_dtype_is_refused_and_nothing_written(adapter, into_base, tmp_path):
    base, src = adapter
    huge = edited_copy(src, tmp_path / "huge", lora_alpha=1e40)
    with pytest.raises(CheckpointError, match=r"the merged update holds inf / NaN in torch\.float32 .*huge"):
        merge_adapters([huge], tmp_path / "out", "simple", base=base, into_base=into_base)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["huge"]


@pytest.mark.parametrize(
    ("change", "text"),
    [
        ({"init_lora_weights": "pissa"}, "init_lora_weights is 'pissa': the adapter applies to the residual base"),
        ({"init_lora_weights": "pissa_niter_4"}, "init_lora_weights is 'pissa_niter_4'"),
        ({"init_lora_weights": "olora"}, "init_lora_weights is 'olora'"),
        ({"use_bdlora": {"target_modules_bd_a": ["q_proj"], "nblocks": 2}}, "use_bdlora is set: it is a block-diag"),
    ],
)
def test_an_adapter_of_another_kind_than_plain_lora_is_refused(adapter, change, text, tmp_path):
    # PiSSA / OLoRA factors apply to W - sBA, which PEFT rebuilds on load; merged onto W they count that part twice
    base, src = adapter
    other = edited_copy(src, tmp_path / "other", **change)
    with pytest.raises(CheckpointError, match=rf"other/adapter_config\.json: {re.escape(text)}"):
        merge_adapters([other], tmp_path / "out", "simple", base=base, into_base=True)


def test_integer_factors_are_refused(adapter, tmp_path):
    from safetensors.torch import load_file, save_file

    _, src = adapter
    q = shutil.copytree(src, tmp_path / "q")
    file = q / "adapter_model.safetensors"
    save_file({k: (v * 100).to(torch.int8) for k, v in load_file(str(file)).items()}, str(file))
    with pytest.raises(CheckpointError, match=r"q/adapter_model\.safetensors: .*lora_\w is stored as torch\.int8"):
        merge_adapters([q], tmp_path / "out", "simple")


def test_the_merged_adapter_holds_every_input_dtype_whatever_their_order(adapter, tmp_path):
    from safetensors.torch import load_file, save_file

    from symfuse.lora import read_adapter

    _, src = adapter
    half = shutil.copytree(src, tmp_path / "half")
    file = half / "adapter_model.safetensors"
    save_file({k: v.half() for k, v in load_file(str(file)).items()}, str(file))
    one = read_adapter(merge_adapters([half, src], tmp_path / "hf", "simple"))
    two = read_adapter(merge_adapters([src, half], tmp_path / "fh", "simple"))
    assert one.dtype == two.dtype == torch.float32
    for key, m in one.modules.items():
        torch.testing.assert_close(m.delta(), two.modules[key].delta(), rtol=1e-5, atol=1e-7)


def test_adapters_of_two_models_are_refused_when_their_configs_name_no_base(tmp_path):
    """A llama adapter and a GPT-2 adapter, base_model_name_or_path null in both, merged with exit 0: PEFT then loaded
    the output on the llama base and dropped the GPT-2 half."""
    llama = make_adapter(tiny_base(tmp_path / "llama"), tmp_path / "l", seed=1)
    gpt2 = make_adapter(save_tiny(tmp_path / "gpt2", "gpt2", head="lm"), tmp_path / "g", seed=2, targets=["c_attn"])
    nameless = [edited_copy(a, tmp_path / f"{a.name}0", base_model_name_or_path=None) for a in (llama, gpt2)]
    with pytest.raises(CheckpointError, match=r"g0: base model class GPT2LMHeadModel, but .*l0 has LlamaForCausalLM"):
        merge_adapters(nameless, tmp_path / "out", "simple")
    for ad in nameless:  # without the class PEFT records: the layer stacks they adapt
        cfg = json.loads((ad / "adapter_config.json").read_text())
        (ad / "adapter_config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "auto_mapping"}))
    with pytest.raises(CheckpointError, match=r"g0: stack of layers transformer\.h, but .*l0 has model\.layers — "):
        merge_adapters(nameless, tmp_path / "out", "simple")
    assert not (tmp_path / "out").exists()


def test_one_base_spelt_two_ways_is_one_base_and_a_rank_past_every_module_is_refused(adapter, tmp_path):
    base, src = adapter
    slash = edited_copy(src, tmp_path / "slash", base_model_name_or_path=f"{base}/")  # was: "adapter of base .../"
    other = edited_copy(make_adapter(base, tmp_path / "made", seed=4), tmp_path / "other",
                        base_model_name_or_path=f"{base}/../{base.name}")  # fmt: skip
    merge_adapters([slash, other], tmp_path / "out", "simple")
    widest = max(min(s) for s in _update_shapes(src))
    with pytest.raises(UsageError, match=rf"--rank: 1000000 is above {widest}, the largest rank an update"):
        merge_adapters([slash, other], tmp_path / "big", "simple", rank=10**6)  # wrote 1.5 GB of zero padding
    with pytest.raises(UsageError, match="--weights: one adapter — weights are normalised to sum to 1"):
        merge_adapters([src], tmp_path / "one", "simple", weights=[0.5])  # was ignored: the output was all of it
    assert not (tmp_path / "big").exists() and not (tmp_path / "one").exists()


def _update_shapes(adapter):
    from safetensors.torch import load_file

    t = load_file(str(adapter / "adapter_model.safetensors"))
    return [(t[n.replace("lora_A", "lora_B")].shape[0], t[n].shape[1]) for n in t if n.endswith("lora_A.weight")]


def test_a_base_alias_is_named_by_its_folder(adapter, tmp_path, monkeypatch):
    """``--base minilm`` was reported as ``--base is <cwd>/minilm``, a folder that does not exist."""
    from symfuse.checkpoint import resolve_checkpoint

    _, src = adapter
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match=rf"but --base is {re.escape(str(resolve_checkpoint('minilm')))} — "):
        merge_adapters([src], tmp_path / "out", "simple", base="minilm", into_base=True)


def test_a_gpt2_dora_adapter_as_peft_saves_it_merges_as_peft_merges_it(tmp_path):
    """PEFT saves a GPT-2 (Conv1D) DoRA adapter with fan_in_fan_out true; it was refused as "not supported", while
    each update is oriented by the base's layer whatever the flag says (as for plain LoRA)."""
    auto = T.AutoModelForCausalLM
    base = save_tiny(tmp_path / "gpt2", "gpt2", head="lm")
    adapter = make_adapter(base, tmp_path / "ad", seed=1, targets=["c_attn", "c_proj"], auto=auto, use_dora=True)
    assert json.loads((adapter / "adapter_config.json").read_text())["fan_in_fan_out"] is True
    want, before = effective_weights(base, adapter, auto), effective_weights(base, None, auto)
    worst, changed = _worst(_merged_into_base(adapter, base, tmp_path / "out", auto), want, before)
    assert len(changed) == 6 and worst < 1e-6  # c_attn and both c_proj of 2 layers: 1.6e-7
    merge_adapters([adapter], tmp_path / "ad2", "simple", base=base)  # as an adapter: PEFT applies it the same
    assert _worst(effective_weights(base, tmp_path / "ad2", auto), want, before)[0] < 1e-6


def test_a_lora_variant_with_tensors_of_its_own_is_refused_without_advice_to_drop_them(adapter, tmp_path):
    """A KaSA adapter ('lora_diag' beside A and B) was told to 'remove it'; without it the merge was wrong, exit 0."""
    from safetensors.torch import load_file, save_file

    _, src = adapter
    kasa = shutil.copytree(src, tmp_path / "kasa")
    file = kasa / "adapter_model.safetensors"
    tensors = load_file(str(file))
    a_name = next(k for k in tensors if k.endswith("lora_A.weight"))
    tensors[a_name.replace("lora_A.weight", "lora_diag")] = torch.ones(tensors[a_name].shape[0])
    save_file(tensors, str(file))
    with pytest.raises(CheckpointError, match=r"lora_diag is not a LoRA A / B / magnitude tensor") as err:
        merge_adapters([kasa], tmp_path / "out", "simple")
    assert "remove it" not in str(err.value) and "merge plain LoRA or DoRA adapters" in str(err.value)


def test_the_merged_adapter_is_readable_by_others_as_every_output(adapter, tmp_path):
    """adapter_model.safetensors was written 0600 where every other file of the folder is 0644."""
    _, src = adapter
    out = merge_adapters([src, src], tmp_path / "out", "simple")
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir() if p.is_file()}
    assert modes["adapter_model.safetensors"] == modes["adapter_config.json"] and modes["adapter_config.json"] & 0o044
