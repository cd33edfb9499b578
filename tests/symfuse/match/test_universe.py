"""residual-orthogonal for K models: onto one anchor, or all onto their mean (universe matching), exactly."""

import json

import pytest
from safetensors.torch import load_file

from symfuse.checkpoint import CheckpointReader
from symfuse.match import disguise_checkpoint
from symfuse.match.universe import align_universe, folded_mean
from symfuse.match.weights import state_sq_distance as sq_distance
from tests.cli.helpers import run_cli
from tests.tiny import save_tiny

KINDS = ["ffn-permutation", "head-permutation", "rotation", "scaling"]


def _state(folder):
    with CheckpointReader(folder) as r:
        return {n: r.get(n).clone() for n in r.names()}, r.spec, r.config


@pytest.mark.parametrize("anchor", ["barycenter", "m0"])
def test_three_disguises_of_one_model_are_aligned_together_exactly(tmp_path, anchor):
    base = save_tiny(tmp_path / "m0", "gpt2", seed=1, head="lm", pad_token_id=0)
    models = [base] + [
        disguise_checkpoint(base, tmp_path / f"m{i}", seed=10 + i, kinds=["residual-orthogonal", *KINDS])
        for i in (1, 2)
    ]
    proc = run_cli("match-many", *models, "--out", tmp_path / "o", "--anchor", anchor, "--max-iter", "3",
                   "--symmetries", "residual-orthogonal," + ",".join(KINDS), "--device", "cpu")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "o" / "symfuse_many_report.json").read_text())
    assert all(m["exact"] and m["max_abs_logit_diff"] <= 1e-4 for m in report["models"])
    states = [load_file(str(tmp_path / "o" / f"m{i}" / "model.safetensors")) for i in range(3)]
    for s in states[1:]:  # the planted maps are undone: the three written models are one
        assert sq_distance(s, states[0]) <= 1e-8 * sq_distance(states[0], {n: 0 * t for n, t in states[0].items()})


def test_a_tied_model_and_its_untied_disguise_are_aligned_together(tmp_path):
    """The disguise of a tied Llama is untied: match-many of the two was a KeyError on 'lm_head.weight'."""
    base = save_tiny(tmp_path / "m0", "llama", seed=1, head="lm", pad_token_id=0, tie_word_embeddings=True)
    models = [base, disguise_checkpoint(base, tmp_path / "m1", seed=3, kinds=["residual-orthogonal", *KINDS])]
    proc = run_cli("match-many", *models, "--out", tmp_path / "o", "--anchor", str(base), "--max-iter", "3",
                   "--symmetries", "residual-orthogonal," + ",".join(KINDS), "--device", "cpu")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "o" / "symfuse_many_report.json").read_text())
    assert all(m["exact"] and m["max_abs_logit_diff"] <= 1e-4 for m in report["models"])


def test_the_universe_mean_sits_nearer_every_model_than_one_anchor_does(tmp_path):
    folders = [save_tiny(tmp_path / f"m{i}", "llama", seed=i, head="lm", pad_token_id=0) for i in range(3)]
    states, spec, config = zip(*(_state(f) for f in folders), strict=True)
    spread = {}
    for mode, anchor in (("universe", None), ("anchor", 0)):
        r = align_universe(states, spec[0], config[0], ["ffn-permutation"], anchor=anchor, rounds=4)
        mean = folded_mean(r.states)
        spread[mode] = sum(sq_distance(s, mean) for s in r.states)
        if anchor is None:
            assert [h["spread"] for h in r.history] == sorted(h["spread"] for h in r.history)[::-1]
    assert spread["universe"] < spread["anchor"]
