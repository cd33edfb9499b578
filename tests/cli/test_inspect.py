"""``symfuse inspect`` on the command line: the JSON mapping, the figure, and bad inputs in one line."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import symfuse.cli.commands  # noqa: F401  (registers the commands)
from symfuse.cli import app
from symfuse.match import disguise_checkpoint
from tests.cli.helpers import run_cli
from tests.tiny import save_tiny


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("inspect-cli")
    a = save_tiny(root / "a", "bert", seed=0)
    return {
        "root": root,
        "a": a,
        "d": disguise_checkpoint(a, root / "d", seed=1, kinds=["rotation", "ffn-permutation", "head-permutation"]),
        "gpt2": save_tiny(root / "gpt2", "gpt2", seed=0),
    }


def test_json_is_one_mapping_with_verdict_reason_and_figures(models):
    png = models["root"] / "inspect.png"
    r = CliRunner().invoke(app, ["inspect", str(models["a"]), str(models["d"]), "--json", "--out", str(png)])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["verdict"] == "align-first" and "moves |B-A|/|A|" in report["reason"]
    pair = report["pairs"][0]
    assert pair["total"]["after"]["all"] < 1e-5 < pair["total"]["before"]
    assert {"module", "before", "after"} <= set(pair["modules"][0])
    assert report["figure"] == str(png) and png.read_bytes()[:4] == b"\x89PNG"
    again = CliRunner().invoke(app, ["inspect", str(models["a"]), str(models["d"]), "--out", str(png)])
    assert again.exit_code == 2 and "already exists" in again.output
    config = models["a"] / "config.json"  # --overwrite replaces a figure, never another file
    kept = config.read_bytes()
    cmd = ["inspect", str(models["a"]), str(models["d"]), "--out", str(config), "--overwrite"]
    refused = CliRunner().invoke(app, cmd)
    assert refused.exit_code == 2 and "name the file .png" in refused.output and config.read_bytes() == kept
    notes = png.parent / "notes.png"  # named like a figure, but not one
    notes.write_text("my notes\n")
    cmd = ["inspect", str(models["a"]), str(models["d"]), "--out", str(notes), "--overwrite"]
    refused = CliRunner().invoke(app, cmd)
    assert refused.exit_code == 2 and "not a PNG image" in refused.output and notes.read_text() == "my notes\n"


def test_the_table_ends_with_the_verdict(models):
    r = CliRunner().invoke(app, ["inspect", str(models["a"]), str(models["a"])], terminal_width=200)
    assert r.exit_code == 0, r.output
    assert "all modules" in r.stdout
    assert r.stdout.strip().splitlines()[-1].startswith("verdict: same-basin")


@pytest.mark.parametrize(
    ("args", "code", "expect"),
    [
        (("{a}",), 2, "at least two"),
        (("{a}", "{root}/missing"), 2, "missing does not exist"),
        (("{a}", "{gpt2}"), 1, "incompatible: models of different families"),
    ],
    ids=["one-model", "missing-folder", "other-family"],
)
def test_bad_inputs_fail_in_one_line(models, args, code, expect):
    r = run_cli("inspect", *(a.format(**{k: str(v) for k, v in models.items()}) for a in args))
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == code, r.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and expect in lines[0], r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
