"""``symfuse merge --align KINDS``: every model aligned onto the first, exactly, before any strategy merges them."""

import json

import torch
from safetensors.torch import load_file

from symfuse.match import disguise_checkpoint
from tests.cli.helpers import run_cli
from tests.tiny import save_tiny

KINDS = "residual-orthogonal,ffn-permutation,head-permutation,rotation,scaling"


def test_slerp_of_a_model_and_its_disguise_gives_the_model_back_once_aligned(tmp_path):
    a = save_tiny(tmp_path / "a", "llama", seed=1, head="lm", pad_token_id=0)
    kinds = ["residual-orthogonal", "ffn-permutation", "head-permutation", "rotation", "scaling"]
    b = disguise_checkpoint(a, tmp_path / "b", seed=3, kinds=kinds)
    for name, extra in (("plain", []), ("aligned", ["--align", KINDS])):
        proc = run_cli("merge", "--strategy", "slerp", "--models", a, b, "--out", tmp_path / name, *extra,
                       "--device", "cpu")  # fmt: skip
        assert proc.returncode == 0, proc.stderr
    want = load_file(str(a / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight"
    plain, aligned = (load_file(str(tmp_path / n / "model.safetensors")) for n in ("plain", "aligned"))
    assert (plain[name] - want[name]).norm() > 0.1 * want[name].norm()  # the disguise does not average away
    for n, t in want.items():
        torch.testing.assert_close(aligned[n], t, rtol=0, atol=1e-4)  # slerp of a model with itself
    report = json.loads((tmp_path / "aligned" / "symfuse_report.json").read_text())
    assert report["models"] == [str(a), str(b)] and report["aligned"] == KINDS.split(",")


def test_what_cannot_be_aligned_first_is_one_line(tmp_path):
    a = save_tiny(tmp_path / "a", "llama", seed=1, head="lm", pad_token_id=0)
    b = save_tiny(tmp_path / "b", "llama", seed=2, head="lm", pad_token_id=0)
    cases = {
        "residual-permutation": "--align: residual-permutation is found from activations — give --align-data",
        "ot,ffn-permutation": "--align: ot, ffn-permutation do not combine",
        "rotaton": "--align: unknown symmetries 'rotaton'",
    }
    for kinds, message in cases.items():
        proc = run_cli("merge", "--strategy", "simple", "--models", a, b, "--out", tmp_path / "m", "--align", kinds,
                       "--device", "cpu")  # fmt: skip
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
        assert not (tmp_path / "m").exists()
