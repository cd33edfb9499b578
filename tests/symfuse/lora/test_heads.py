"""SEQ_CLS adapters: PEFT trains the classifier whole (modules_to_save); merges keep one head per adapter."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
import transformers as T
from peft import LoraConfig, PeftModel, TaskType, get_peft_model
from safetensors.torch import load_file, save_file

from symfuse.errors import CheckpointError, UsageError
from symfuse.lora import merge_adapters
from tests.symfuse.lora.helpers import edited_copy, effective_weights, worst
from tests.tiny import save_tiny, tiny_config

AUTO = T.AutoModelForSequenceClassification
HEAD = ("classifier.weight", "classifier.bias")


def _adapter(base, out, seed, targets=("query", "value"), **kw):
    """A PEFT SEQ_CLS adapter of ``base`` with random factors and a random trained classifier."""
    model = AUTO.from_pretrained(str(base))
    torch.manual_seed(seed)
    cfg = LoraConfig(task_type=TaskType.SEQ_CLS, r=4, lora_alpha=8, target_modules=list(targets),
                     init_lora_weights=False, **kw)  # fmt: skip
    peft = get_peft_model(model, cfg)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name or "modules_to_save" in name:
                p.copy_(0.3 * torch.randn_like(p))
    peft.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def seq_cls(tmp_path_factory):
    d = tmp_path_factory.mktemp("seqcls")
    base = save_tiny(d / "base", "bert", head="seq", num_labels=3)
    return base, _adapter(base, d / "a", 1), _adapter(base, d / "b", 2)


def _weights(folder, adapter=None):
    return effective_weights(folder, adapter, AUTO)


def _headless(adapter, out):
    """``adapter`` without its saved classifier (what its LoRA factors alone update)."""
    shutil.copytree(adapter, out)
    cfg = json.loads((out / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps(cfg | {"modules_to_save": None}))
    file = out / "adapter_model.safetensors"
    save_file({k: v for k, v in load_file(str(file)).items() if "lora_" in k}, str(file), metadata={"format": "pt"})
    return out


def test_one_seq_cls_adapter_goes_into_the_base_as_peft_merges_it(seq_cls, tmp_path):
    # it was refused: "modules_to_save is set: it stores whole modules"
    base, a, _ = seq_cls
    out = merge_adapters([a], tmp_path / "out", "simple", base=base, into_base=True)
    want = _weights(base, a)
    assert not torch.equal(want[HEAD[0]], _weights(base)[HEAD[0]])
    assert worst(_weights(out), want) < 1e-6


def test_two_seq_cls_adapters_give_one_merged_body_and_each_its_own_head(seq_cls, tmp_path):
    base, a, b = seq_cls
    out = merge_adapters([a, b], tmp_path / "out", "ties", base=base, into_base=True, density=0.5)
    first, second = _weights(out), _weights(out / "heads" / "b")
    body = _weights(merge_adapters([_headless(a, tmp_path / "ha"), _headless(b, tmp_path / "hb")], tmp_path / "body",
                                   "ties", base=base, into_base=True, density=0.5))  # fmt: skip
    for name in HEAD:  # each adapter's head as PEFT loads it, over the merged body the adapters' factors make
        assert torch.equal(first[name], _weights(base, a)[name]) and torch.equal(second[name], _weights(base, b)[name])
    for k in body:
        if k not in HEAD:
            assert torch.equal(first[k], body[k]) and torch.equal(second[k], body[k]), k
    report = json.loads((out / "symfuse_report.json").read_text())
    assert report["heads"] == [{"adapter": str(a), "folder": "."}, {"adapter": str(b), "folder": "heads/b"}]
    twice = merge_adapters([a, a], tmp_path / "twice", "simple", base=base, into_base=True)  # one folder given twice
    assert torch.equal(_weights(twice)[HEAD[0]], first[HEAD[0]]) and (twice / "heads" / "a").is_dir()


def test_merged_seq_cls_adapters_load_in_peft_as_the_merged_models(seq_cls, tmp_path):
    base, a, b = seq_cls
    models = merge_adapters([a, b], tmp_path / "models", "simple", base=base, into_base=True)
    adapter = merge_adapters([a, b], tmp_path / "adapter", "simple")
    assert json.loads((adapter / "adapter_config.json").read_text())["modules_to_save"] == ["classifier", "score"]
    assert worst(_weights(base, adapter), _weights(models)) < 1e-6
    assert worst(_weights(base, adapter / "heads" / "b"), _weights(models / "heads" / "b")) < 1e-6


def test_adapters_of_other_heads_or_a_base_without_the_head_are_refused(seq_cls, tmp_path):
    _, a, _ = seq_cls
    with pytest.raises(CheckpointError, match=r"ha: saves the modules none, .*/a classifier\.bias, classifier\.weight"):
        merge_adapters([a, _headless(a, tmp_path / "ha")], tmp_path / "out", "simple")
    five = tmp_path / "five"  # a classifier of 5 classes
    T.BertForSequenceClassification(tiny_config("bert", num_labels=5)).save_pretrained(five)
    moved = edited_copy(a, tmp_path / "moved", base_model_name_or_path=str(five))
    text = r"moved: saves classifier\.\w+ \(3.*\) \(modules_to_save\), and the base holds it as \(5"
    with pytest.raises(CheckpointError, match=text):
        merge_adapters([moved], tmp_path / "out", "simple", base=five, into_base=True)
    assert not (tmp_path / "out").exists()


def test_the_command_names_where_each_other_head_went(seq_cls, tmp_path):
    from typer.testing import CliRunner

    from symfuse.cli import app
    from symfuse.cli import commands as _commands  # noqa: F401  (registers the commands)

    _, a, b = seq_cls
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["merge-lora", "--adapters", str(a), str(b), "--strategy", "simple", "--out",
                                   str(out)], terminal_width=200)  # fmt: skip
    assert res.exit_code == 0, res.output
    assert f"with {b}'s head: {out / 'heads' / 'b'}" in res.output
    assert (out / "heads" / "b" / "adapter_model.safetensors").is_file()


def test_a_bare_base_is_built_as_the_classifier_peft_trained_on(seq_cls, tmp_path, caplog):
    """A base saved as BertModel ('encoder...', no head) was refused: PEFT users load it as a classifier."""
    _, a, _ = seq_cls
    bare = tmp_path / "bare"
    T.BertModel(tiny_config("bert")).save_pretrained(bare)
    moved = edited_copy(a, tmp_path / "moved", base_model_name_or_path=str(bare))
    out = merge_adapters([moved], tmp_path / "out", "simple", base=bare, into_base=True)
    peft = PeftModel.from_pretrained(AUTO.from_pretrained(str(bare), num_labels=3), str(moved)).merge_and_unload()
    assert worst(_weights(out), {k: v.detach().double() for k, v in peft.state_dict().items()}) < 1e-6
    assert json.loads((out / "config.json").read_text())["architectures"] == ["BertForSequenceClassification"]
    assert "merged into it built as BertForSequenceClassification with 3 classes, unnamed" in caplog.text
    # the adapter output takes the same base (it was refused: "stores the bare model"), and PEFT loads it alike
    adapter = merge_adapters([moved], tmp_path / "ad", "simple", base=bare)
    again = PeftModel.from_pretrained(AUTO.from_pretrained(str(bare), num_labels=3), str(adapter)).merge_and_unload()
    assert worst({k: v.detach().double() for k, v in again.state_dict().items()}, _weights(out)) < 1e-6


def test_a_bare_base_of_a_causal_lm_adapter_is_told_to_be_saved_as_the_task_model(tmp_path):
    """A LlamaModel base ('layers...') was told it lacked 'model.layers...' and to give the right base."""
    from tests.symfuse.lora.helpers import make_adapter, tiny_base

    base = tiny_base(tmp_path / "base")
    bare = tmp_path / "bare"
    T.LlamaModel(tiny_config("llama")).save_pretrained(bare)
    adapter = edited_copy(make_adapter(base, tmp_path / "made", seed=1), tmp_path / "ad",
                          base_model_name_or_path=str(bare))  # fmt: skip
    with pytest.raises(CheckpointError, match=r"bare: stores the bare model \(layers\.\d.*\), the adapters its task "
                                              r"model \(model\.layers\..*save the base as the model they were "
                                              r"trained on"):  # fmt: skip
        merge_adapters([adapter], tmp_path / "out", "simple", base=bare, into_base=True)


@pytest.mark.parametrize("kept", [(), ("classifier.bias",)], ids=["no-head", "bias-only"])
def test_a_head_saved_in_part_or_not_at_all_is_refused(seq_cls, kept, tmp_path):
    """PEFT cannot load such an adapter; the merge kept the base's random head (or half of it), exit 0."""
    base, a, _ = seq_cls
    cut = shutil.copytree(a, tmp_path / "cut")
    file = cut / "adapter_model.safetensors"
    tensors = load_file(str(file))
    save_file({k: v for k, v in tensors.items() if "lora_" in k or k.endswith(kept or ("-",))}, str(file))
    text = "saves classifier.bias without classifier.weight" if kept else "match the base's classifier.bias"
    for into_base in (True, False):  # the adapter output PEFT cannot load onto that base either
        with pytest.raises(CheckpointError, match=re.escape(text)):
            merge_adapters([cut], tmp_path / "out", "simple", base=base, into_base=into_base)
    assert not (tmp_path / "out").exists()


def test_a_module_whose_name_ends_with_an_entry_is_a_saved_head_as_peft_matches_it(tmp_path):
    """DistilBERT's pre_classifier matches modules_to_save 'classifier' in PEFT (a suffix); it was refused."""
    base = tmp_path / "base"
    T.DistilBertForSequenceClassification(tiny_config("distilbert")).save_pretrained(base)
    _adapter(base, tmp_path / "ad", seed=3, targets=("q_lin", "v_lin"))
    assert any("pre_classifier" in k for k in load_file(str(tmp_path / "ad" / "adapter_model.safetensors")))
    out = merge_adapters([tmp_path / "ad"], tmp_path / "out", "simple", base=base, into_base=True)
    assert worst(_weights(out), _weights(base, tmp_path / "ad")) < 1e-6


def test_body_layers_trained_whole_merge_as_full_models_do_and_heads_stay_apart(seq_cls, tmp_path):
    """modules_to_save inside the layers: the output took the first adapter's copies whole, and said nothing."""
    base = seq_cls[0]
    a, b = (_adapter(base, tmp_path / n, s, modules_to_save=["intermediate.dense"]) for n, s in (("a", 4), ("b", 5)))
    name = "bert.encoder.layer.0.intermediate.dense.weight"
    copies = [load_file(str(x / "adapter_model.safetensors"))[f"base_model.model.{name}"] for x in (a, b)]
    model = merge_adapters([a, b], tmp_path / "model", "simple", base=base, into_base=True)
    first, second = _weights(model), _weights(model / "heads" / "b")
    assert torch.allclose(first[name], (copies[0].double() + copies[1].double()) / 2, atol=1e-6)  # W + mean(W_i - W)
    assert torch.equal(first[name], second[name]) and not torch.equal(first[HEAD[0]], second[HEAD[0]])
    adapter = merge_adapters([a, b], tmp_path / "adapter", "simple", base=base)
    assert worst(_weights(base, adapter), first) < 1e-6
    with pytest.raises(UsageError, match=r"--base: missing — .*trains bert\.encoder\.layer\.\d\.intermediate"):
        merge_adapters([a, b], tmp_path / "nobase", "simple")
