"""residual-orthogonal from weights: a disguise by a random stream map (and module maps) is found again, exactly."""

import json

import pytest
import torch
from safetensors.torch import load_file

from symfuse.match import disguise_checkpoint, match_checkpoints
from symfuse.match.verify import full_logit_diff
from tests.cli.helpers import run_cli
from tests.tiny import save_tiny

KINDS = ["ffn-permutation", "head-permutation", "rotation", "scaling"]


@pytest.mark.parametrize(("family", "head"), [("gpt2", "lm"), ("llama", "lm"), ("gpt2", "seq")])
def test_disguise_and_match_back(tmp_path, family, head):
    anchor = save_tiny(tmp_path / "a", family, seed=1, head=head, pad_token_id=0)
    src = disguise_checkpoint(anchor, tmp_path / "d", seed=4, kinds=["residual-orthogonal", *KINDS])
    diff, scale = full_logit_diff(src, anchor)
    assert diff <= 1e-4 * scale  # the disguise computes the anchor's function
    report = match_checkpoints(src, anchor, tmp_path / "m", ["residual-orthogonal", *KINDS])
    assert report["exact"] is True and report["max_abs_logit_diff"] <= 1e-4
    assert report["distance_after"] <= 1e-4 * report["distance_before"]  # the planted map is recovered
    got, want = load_file(str(tmp_path / "m" / "model.safetensors")), load_file(str(anchor / "model.safetensors"))
    for name, t in want.items():  # the anchor's own weights and norms, in the anchor's parametrisation
        torch.testing.assert_close(got[name], t, rtol=0, atol=1e-4)
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["architectures"] == json.loads((anchor / "config.json").read_text())["architectures"]


def test_cli_and_post_ln_refusal(tmp_path):
    a = save_tiny(tmp_path / "a", "llama", seed=1, head="lm", pad_token_id=0)
    b = save_tiny(tmp_path / "b", "llama", seed=2, head="lm", pad_token_id=0)  # an independent init
    proc = run_cli("match", b, a, "--out", tmp_path / "m", "--symmetries", "residual-orthogonal,ffn-permutation",
                   "--device", "cpu")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "m" / "symfuse_report.json").read_text())
    assert report["exact"] and report["distance_after"] < report["distance_before"]
    assert report["history"] == sorted(report["history"], reverse=True)  # the distance never rises
    bert = save_tiny(tmp_path / "bert", "bert", seed=1)
    proc = run_cli("match", bert, bert, "--out", tmp_path / "x", "--symmetries", "residual-orthogonal")
    assert proc.returncode == 1 and not (tmp_path / "x").exists()
    assert proc.stderr.strip().splitlines()[-1].startswith("error: bert: an orthogonal map of the residual stream")
