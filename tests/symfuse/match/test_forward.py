"""The plain-torch forward of the match command's output check equals transformers' model, family by family."""

import subprocess
import sys

import pytest
import torch

from symfuse.checkpoint import CheckpointReader, load_hf_model
from symfuse.errors import VerificationError
from symfuse.match import match_checkpoints, pipeline
from symfuse.match.forward import plain_forward, plain_forward_supported
from symfuse.symmetry.transforms import FFNPermutation
from tests.tiny import DECODERS, FAMILIES, save_tiny

PLAIN = ("bert", "roberta", "distilbert", "electra", "gpt2", "llama", "qwen3")
SYMS = ["rotation", "scaling", "ffn-permutation", "head-permutation"]


def _head(family):
    return "lm" if family in DECODERS else "seq"


@pytest.mark.parametrize("family", PLAIN)
def test_plain_forward_equals_the_transformers_model(family, tmp_path):
    src = save_tiny(tmp_path / "m", family, seed=3, head=_head(family))
    with CheckpointReader(src) as r:
        assert plain_forward_supported(r.spec, r.config)
        inputs = r.spec.random_inputs(r.config, generator=torch.Generator().manual_seed(5))
        assert not inputs["attention_mask"].all()  # padding is exercised
        out = plain_forward(r, inputs)
    model = load_hf_model(src, dtype=torch.float32)
    with torch.no_grad():
        ref = model.base_model(**inputs).last_hidden_state
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - set(PLAIN)))
def test_families_without_a_plain_forward_keep_the_transformers_check(family, tmp_path):
    src = save_tiny(tmp_path / "m", family, seed=3, head=_head(family))
    with CheckpointReader(src) as r:
        assert not plain_forward_supported(r.spec, r.config)


def test_configs_the_plain_forward_cannot_follow_fall_back(tmp_path):
    scaled = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    for name, overrides in {
        "scaled rope": {"rope_parameters": scaled},
        "unknown activation": {"hidden_act": "gelu_10"},
        "short sliding window": {"sliding_window": 4},
    }.items():
        src = save_tiny(tmp_path / name.replace(" ", "_"), "llama", seed=1, head="lm", **overrides)
        with CheckpointReader(src) as r:
            assert not plain_forward_supported(r.spec, r.config), name
    # position terms inside attention (BERT's relative_key): a Q/K map must move them too, so only transformers'
    # model checks it
    src = save_tiny(tmp_path / "rel", "bert", seed=1, head="seq")
    with CheckpointReader(src) as r:
        assert plain_forward_supported(r.spec, r.config)
        r.config.position_embedding_type = "relative_key"
        assert not plain_forward_supported(r.spec, r.config)


@pytest.mark.parametrize("family", ["roberta", "llama"])
def test_plain_check_passes_a_matched_model_and_catches_a_wrong_one(family, tmp_path, monkeypatch):
    src = save_tiny(tmp_path / "src", family, seed=1, head=_head(family))
    anc = save_tiny(tmp_path / "anc", family, seed=2, head=_head(family))
    report = match_checkpoints(src, anc, tmp_path / "ok", symmetries=SYMS)
    assert report["verify"] == "stream" and report["max_abs_logit_diff"] <= 1e-4
    real = FFNPermutation.apply  # the down columns stay put: the FFN output changes
    monkeypatch.setattr(FFNPermutation, "apply", lambda self, w: {**real(self, w), "down": w["down"]})
    monkeypatch.setattr(pipeline, "check_module_transform", lambda *a, **k: 0.0)
    with pytest.raises(VerificationError, match="outputs differ from"):
        match_checkpoints(src, anc, tmp_path / "bad", symmetries=SYMS)
    assert not (tmp_path / "bad").exists()


def test_the_match_command_imports_no_transformers_modelling_code(tmp_path):
    src = save_tiny(tmp_path / "src", "roberta", seed=1, head="seq")
    anc = save_tiny(tmp_path / "anc", "roberta", seed=2, head="seq")
    code = (
        "import sys\n"
        "from symfuse.match import match_checkpoints\n"
        f"r = match_checkpoints({str(src)!r}, {str(anc)!r}, {str(tmp_path / 'out')!r})\n"
        "assert r['verify'] == 'stream' and r['max_abs_logit_diff'] is not None\n"
        "mods = [m for m in sys.modules if m.startswith('transformers.models.') and '.modeling_' in m]\n"
        "print(sorted(m for m in mods if not m.startswith('transformers.models.auto.')))\n"  # name tables only
        "print('transformers.modeling_utils' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split("\n")[:2] == ["[]", "False"], out.stdout + out.stderr


@pytest.mark.parametrize("family", ["bert", "llama", "qwen3"])
def test_plain_forward_reads_each_stored_tensor_once(family, tmp_path, monkeypatch):
    from collections import Counter

    from symfuse.match import forward

    src = save_tiny(tmp_path / "m", family, seed=1, head=_head(family))
    reads: Counter[str] = Counter()
    real = forward._Run.get
    monkeypatch.setattr(forward._Run, "get", lambda self, name, *a: reads.update([name]) or real(self, name, *a))
    with CheckpointReader(src) as r:
        plain_forward(r, r.spec.random_inputs(r.config))
        modules = {n for ref in r.modules() for n in r.module_tensor_names(ref)}
    assert reads and max(reads.values()) == 1, reads.most_common(3)  # a membership test reads nothing
    assert modules <= set(reads)  # every module tensor took part


def test_a_damaged_copy_of_a_head_is_caught(tmp_path, monkeypatch):
    # the hidden states never see the task head: its copy is compared with SOURCE's bit for bit instead
    src = save_tiny(tmp_path / "src", "roberta", seed=1, head="seq")
    anc = save_tiny(tmp_path / "anc", "roberta", seed=2, head="seq")
    real = pipeline.PlannedCheckpoint.write

    def damaging(self, name, tensor, first_row=0):
        if name.startswith("classifier.out_proj.weight"):
            tensor = tensor.clone()
            tensor.view(-1)[0] += 1.0
        return real(self, name, tensor, first_row)

    monkeypatch.setattr(pipeline.PlannedCheckpoint, "write", damaging)
    with pytest.raises(VerificationError, match=r"classifier\.out_proj\.weight differs from .* only copies"):
        match_checkpoints(src, anc, tmp_path / "out", symmetries=SYMS)
    assert not (tmp_path / "out").exists()
