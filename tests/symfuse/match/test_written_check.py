"""What a match writes is what its report describes: ViT (renamed modules in memory) through every driver."""

import json

import pytest
from safetensors.torch import load_file

from symfuse.match import disguise_checkpoint
from symfuse.match.output_check import full_logit_diff
from tests.cli.helpers import run_cli
from tests.tiny import save_tiny


@pytest.mark.parametrize(
    "args",
    [
        ("--symmetries", "ot,rotation,scaling"),
        ("--symmetries", "residual-permutation,ffn-permutation,head-permutation", "--data", "random-pixels"),
    ],
)
def test_vit_written_model_computes_the_source_function(tmp_path, args):
    anchor = save_tiny(tmp_path / "vit", "vit", seed=1, head="seq")
    src = disguise_checkpoint(anchor, tmp_path / "vit-r", seed=2, kinds=["rotation", "scaling", "ffn-permutation"])
    out = tmp_path / "m"
    proc = run_cli("match", src, anchor, "--out", out, *args, "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    report = json.loads((out / "symfuse_report.json").read_text())
    diff, scale = full_logit_diff(out, src)  # the folder on disk, reloaded
    assert report["exact"] is True and diff <= 1e-4 * scale
    assert report["max_abs_logit_diff"] == pytest.approx(diff, abs=1e-6)
    assert report["distance_after"] < report["distance_before"]
    written, source, target = (load_file(str(f / "model.safetensors")) for f in (out, src, anchor))
    layers = [n for n in written if ".layer." in n and n.endswith("weight") and written[n].dim() == 2]
    moved = sum(float((written[n] - target[n]).norm() ** 2) for n in layers)  # the layers were really transformed
    assert layers and moved < 0.9 * sum(float((source[n] - target[n]).norm() ** 2) for n in layers)
