"""``symfuse match`` / ``symfuse disguise``: the report, and one-line errors that leave OUT absent."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import symfuse.cli.match  # noqa: F401  (registers the commands)
from symfuse.cli import app
from tests.tiny import save_tiny


def _run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_disguise_then_match_prints_report(tmp_path):
    src = save_tiny(tmp_path / "src", "bert", seed=1, head="seq")
    r = _run("disguise", src, "--out", tmp_path / "d", "--seed", 1)
    assert r.exit_code == 0, r.output
    r = _run(
        "match",
        tmp_path / "d",
        src,
        "--out",
        tmp_path / "m",
        "--symmetries",
        "rotation,scaling,ffn-permutation,head-permutation",
    )
    assert r.exit_code == 0, r.output
    report = json.loads((tmp_path / "m" / "symfuse_report.json").read_text())
    assert report["max_abs_logit_diff"] <= 1e-4 and report["distance_after"] < 1e-4
    assert '"distance_after"' in r.output
    for key in ("distance_before", "distance_after", "max_abs_logit_diff", "per_module", "seconds"):
        assert key in report


def _nan_copy(src, out):
    out.mkdir()
    for f in src.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    sd = load_file(src / "model.safetensors")
    name = next(k for k in sd if k.endswith("attention.self.query.weight"))
    sd[name][0, 0] = float("nan")
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("case", ["family", "shape", "missing", "nan", "symmetry"])
def test_errors_are_one_line_and_out_is_not_created(case, tmp_path):
    src = save_tiny(tmp_path / "src", "bert", seed=1)
    if case == "family":
        anchor, expect = save_tiny(tmp_path / "gpt", "gpt2"), "gpt2"
    elif case == "shape":
        anchor, expect = save_tiny(tmp_path / "wide", "bert", intermediate_size=64), "wide"
    elif case == "missing":
        (tmp_path / "empty").mkdir()
        (tmp_path / "empty" / "config.json").write_text((src / "config.json").read_text())
        anchor, expect = tmp_path / "empty", "empty"
    elif case == "nan":
        anchor, expect = _nan_copy(src, tmp_path / "nan"), "NaN"
    else:
        anchor, expect = src, "unknown symmetries"
    syms = "rotation,bogus" if case == "symmetry" else "rotation,scaling,ffn-permutation"
    r = _run("match", src, anchor, "--out", tmp_path / "out", "--symmetries", syms)
    assert r.exit_code != 0
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and expect in lines[0], r.output
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]
    assert torch.isfinite(load_file(src / "model.safetensors")[next(iter(load_file(src / "model.safetensors")))]).all()


def test_max_examples_without_data_is_refused(tmp_path):
    """It limits --data's examples: without --data it was accepted and changed nothing."""
    from typer.testing import CliRunner

    import symfuse.cli.commands  # noqa: F401  (registers the commands)
    from symfuse.cli import app
    from tests.tiny import save_tiny

    a, b = (save_tiny(tmp_path / n, "bert", seed=s, head="seq") for n, s in (("a", 1), ("b", 2)))
    r = CliRunner().invoke(app, ["match", str(b), str(a), "--max-examples", "5", "--out", str(tmp_path / "m")])
    assert r.exit_code == 2 and "--max-examples: limits --data's examples — add --data DATASET" in r.output
    assert not (tmp_path / "m").exists()
