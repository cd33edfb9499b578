"""Widening: a narrow model embedded exactly in a wider one's shapes, then aligned and merged (issue 32, item 4)."""

import json

import pytest
import torch
from safetensors.torch import load_file

from symfuse.arch import get_spec
from symfuse.match.output_check import full_logit_diff
from symfuse.symmetry.widen import widen_state
from tests.cli.helpers import run_cli
from tests.tiny import random_inputs, save_tiny, tiny_model

# the same head dimension (8), twice the stream, heads (and KV groups) and FFN units
WIDE = {
    "gpt2": dict(n_embd=64, n_head=8, n_inner=96),
    "llama": dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=4, intermediate_size=96, head_dim=8),
}


def _widened_diff(family, embed=None):
    narrow, wide = tiny_model(family, 1, "lm"), tiny_model(family, 2, "lm", **WIDE[family])
    state, config = widen_state(narrow.state_dict(), get_spec(narrow.config), narrow.config, wide.config, embed)
    model = type(wide)(config).eval()
    model.load_state_dict(state)  # strict: every tensor of the wide class, in its shapes
    assert {n: t.shape for n, t in state.items()} == {n: t.shape for n, t in model.state_dict().items()}
    x = random_inputs(narrow)
    with torch.no_grad():
        want, got = narrow(**x).logits, model(**x).logits
    return float((got - want).abs().max()) / float(want.abs().max()), narrow, config


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_widened_model_computes_the_narrow_function(family):
    rel, narrow, config = _widened_diff(family)
    assert rel <= 1e-4
    key = "layer_norm_epsilon" if family == "gpt2" else "rms_norm_eps"
    assert getattr(config, key) == pytest.approx(getattr(narrow.config, key) / 2)  # eps scaled by d_n / d_w
    assert config.tie_word_embeddings is False  # the head reads the wider stream through its own tensor


def test_a_map_not_fixing_ones_breaks_layernorm_only():
    first = torch.eye(32, 64, dtype=torch.float64)  # the first 32 coordinates: ones are not mapped to ones
    assert _widened_diff("gpt2", first)[0] > 1e-2  # LayerNorm's centring no longer commutes
    assert _widened_diff("llama", first)[0] <= 1e-4  # RMSNorm takes any semi-orthogonal map


def test_cli_match_narrow_into_wide(tmp_path):
    narrow = save_tiny(tmp_path / "n", "gpt2", 1, head="lm", pad_token_id=0)
    wide = save_tiny(tmp_path / "w", "gpt2", 2, head="lm", pad_token_id=0, **WIDE["gpt2"])
    args = ("--symmetries", "residual-orthogonal,ffn-permutation,head-permutation", "--device", "cpu")
    proc = run_cli("match", narrow, wide, "--out", tmp_path / "m", *args)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "m" / "symfuse_report.json").read_text())
    assert report["exact"] is True and report["widened_from"]["d_model"] == 32
    assert report["distance_after"] < report["distance_before"]
    got, want = load_file(str(tmp_path / "m" / "model.safetensors")), load_file(str(wide / "model.safetensors"))
    assert all(got[n].shape == t.shape for n, t in want.items())  # the wide model's shapes
    diff, scale = full_logit_diff(tmp_path / "m", narrow)  # reloaded from disk: the NARROW model's function
    assert diff <= 1e-4 * scale
    proc = run_cli("match", narrow, wide, "--out", tmp_path / "x", "--symmetries", "ffn-permutation")
    assert proc.returncode == 1 and not (tmp_path / "x").exists()
    assert "align only with --symmetries residual-orthogonal" in proc.stderr.strip().splitlines()[-1]


def test_a_post_ln_pair_of_two_widths_is_not_sent_to_a_widening_it_refuses(tmp_path):
    """bert of FFN 64 vs 48 was told to use residual-orthogonal, which then said only pre-norm families widen."""
    a = save_tiny(tmp_path / "a", "bert", 0, head="seq")
    wide = save_tiny(tmp_path / "w", "bert", 1, head="seq", intermediate_size=64)
    proc = run_cli("match", wide, a, "--out", tmp_path / "m", "--device", "cpu")
    line = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and "have different shapes" in line, proc.stderr
    assert "bert is post-LN, and models of different widths align only in pre-norm families" in line
    assert "residual-orthogonal" not in line


@pytest.mark.parametrize(
    ("family", "narrow_cfg", "wide_cfg", "swap", "says"),
    [
        ("gpt2", {}, dict(n_embd=64, n_inner=96), False, "layer count and head dimension must match"),
        ("bert", {}, dict(hidden_size=64, num_attention_heads=8), False, "bert is post-LN"),
        ("gpt2", {}, WIDE["gpt2"], True, "the target is narrower"),
    ],
)
def test_refusals_are_one_line(tmp_path, family, narrow_cfg, wide_cfg, swap, says):
    a = save_tiny(tmp_path / "a", family, 1, **narrow_cfg)
    b = save_tiny(tmp_path / "b", family, 2, **wide_cfg)
    src, anc = (b, a) if swap else (a, b)
    proc = run_cli("match", src, anc, "--out", tmp_path / "m", "--symmetries", "residual-orthogonal")
    assert proc.returncode == 2 and not (tmp_path / "m").exists()
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: cannot widen {family} (d ") and says in last, proc.stderr
