"""`symfuse merge --refit-heads` on tiny BERTs (flags and YAML); its bad inputs: one line, nothing written."""

import json

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from symfuse.cli import app
from symfuse.cli import commands as _commands  # noqa: F401  (registers the commands)
from tests.cli.helpers import assert_merge_refused
from tests.symfuse.merge.test_regmean_plusplus_cli import tiny  # noqa: F401  (the fixture)
from tests.tiny import save_tiny

runner = CliRunner()


def _ok(args):
    res = runner.invoke(app, list(map(str, args)))
    assert res.exit_code == 0, res.output
    return res


def test_refit_heads_rewrites_only_the_heads_and_reports_them(tiny):  # noqa: F811
    d, folders, data = tiny
    _ok(["merge", "--strategy", "simple", "--models", *folders, "--out", d / "kept"])
    _ok(["merge", "--strategy", "simple", "--models", *folders, "--data", *data, "--refit-heads",
         "--refit-ridge", "0.05", "--max-examples", "6", "--out", d / "refit"])  # fmt: skip
    report = json.loads((d / "refit" / "symfuse_report.json").read_text())
    refit = report["heads"]["refit"]
    assert refit["ridge"] == 0.05 and set(refit["heads"]) == {".", "heads/fearful"}
    for rel, head in refit["heads"].items():
        assert head["rows"] == 6 and head["logit_mse_after"] < head["logit_mse_before"]
        kept, new = (load_file(str(d / v / rel / "model.safetensors")) for v in ("kept", "refit"))
        assert not torch.equal(kept["classifier.weight"], new["classifier.weight"])
        assert all(torch.equal(kept[n], new[n]) for n in kept if not n.startswith("classifier"))
    assert "refitted to the merged body" in (d / "refit" / "README.md").read_text()
    cfg = d / "merge.yaml"  # the same from a YAML file
    cfg.write_text(f"strategy: simple\nmodels: [{folders[0]}, {folders[1]}]\n"
                   f"head_refit: {{data: [{data[0]}, {data[1]}], ridge: 0.05, max_examples: 6}}\n")  # fmt: skip
    _ok(["merge", "--config", cfg, d / "refit-yaml"])
    for rel in refit["heads"]:
        a, b = (load_file(str(d / v / rel / "model.safetensors")) for v in ("refit", "refit-yaml"))
        assert all(torch.equal(a[n], b[n]) for n in a)


def test_data_of_another_label_set_is_refused_unless_allowed(tiny):  # noqa: F811
    d, folders, data = tiny  # joyful: 2 classes, fearful: 3; heads of as many unnamed outputs
    swapped = ["merge", "--strategy", "simple", "--models", *folders, "--data", data[1], data[0], "--refit-heads"]
    res = runner.invoke(app, [*map(str, swapped), "--out", str(d / "swapped")])
    assert res.exit_code == 2 and not (d / "swapped").exists()
    assert (
        f"--data: {data[1]} (for {folders[0]}) has 3 classes for a head of 2 unnamed outputs — give each " in res.output
    )
    assert "in model order, or add --allow-label-mismatch" in res.output
    scores = d / "scores"  # regression data (a score per record) for a head of classes
    scores.mkdir()
    rows = "".join(json.dumps({"text": f"t {i}", "text_pair": "u", "label": i / 4}) + "\n" for i in range(4))
    for split in ("train", "validation", "test"):
        (scores / f"{split}.jsonl").write_text(rows)
    (scores / "meta.json").write_text('{"task": "regression"}')
    res = runner.invoke(app, [*map(str, [*swapped[:-4], "--data", scores, data[1], "--refit-heads"]), "--out",
                              str(d / "scores-out")])  # fmt: skip
    assert res.exit_code == 2 and "holds regression scores, no classes, for a head of 2 classes" in res.output, (
        res.output
    )
    _ok([*swapped, "--max-examples", "6", "--allow-label-mismatch", "--out", d / "swapped"])  # the user knows
    assert (d / "swapped" / "symfuse_report.json").is_file()
    cfg = d / "swapped.yaml"
    cfg.write_text(f"strategy: simple\nmodels: [{folders[0]}, {folders[1]}]\n"
                   f"head_refit: {{data: [{data[1]}, {data[0]}], max_examples: 6}}\n")  # fmt: skip
    res = runner.invoke(app, ["merge", "--config", str(cfg), str(d / "swapped-yaml")])
    assert (
        res.exit_code == 2
        and "put allow_label_mismatch: true in" in res.output
        and f"{cfg}: head_refit.data" in res.output
    )
    cfg.write_text(cfg.read_text() + "allow_label_mismatch: true\n")
    _ok(["merge", "--config", cfg, d / "swapped-yaml"])


@pytest.mark.parametrize(
    ("args", "code", "expect"),
    [
        ("--models {A} {B} --refit-heads", 2, "--data: head refit reads each model's own data"),
        ("--models {A} {B} --refit-heads --data {DATA}", 2, "--data: 1 dataset(s) for 2 models"),
        ("--models {A} {B} --refit-heads --data {DATA} {DATA} --refit-ridge 0", 2, "--refit-ridge"),
        ("--models {A} {B} --refit-heads --data {DATA} {DATA} --max-examples 0", 2, "--max-examples"),
        ("--models {A} {B} --refit-heads --data {DATA} {DATA} --device gpu9", 2, "--device"),
        ("--models {A} {B} --refit-heads --data {DATA} nosuch_dataset", 1, "nosuch_dataset"),
        ("--models {A} {B} --refit-ridge 0.1", 2, "--refit-ridge: given without --refit-heads"),
    ],
    ids=["no-data", "data-count", "ridge-zero", "max-examples-zero", "bad-device", "unknown-dataset", "ridge-alone"],
)
def test_bad_refit_inputs_fail_in_one_line(tmp_path, args, code, expect):
    assert_merge_refused(tmp_path, "simple", args, code, expect)


def test_merge_yaml_head_refit_errors_name_the_key(tmp_path):
    a, b = save_tiny(tmp_path / "a", "bert", seed=1), save_tiny(tmp_path / "b", "bert", seed=2)
    cfg = tmp_path / "merge.yaml"
    cfg.write_text(f"strategy: simple\nmodels: [{a}, {b}]\nhead_refit: {{data: [x]}}\n")
    res = runner.invoke(app, ["merge", "--config", str(cfg), str(tmp_path / "o")])
    assert res.exit_code == 2 and f"{cfg}: head_refit.data: 1 dataset(s) for 2 models" in res.output
    cfg.write_text(f"strategy: simple\nmodels: [{a}, {b}]\nhead_refit: {{data: [x, x], rigde: 1}}\n")
    res = runner.invoke(app, ["merge", "--config", str(cfg), str(tmp_path / "o")])
    assert res.exit_code == 2 and f"{cfg}: head_refit.rigde: Extra inputs are not permitted" in res.output
    res = runner.invoke(app, ["merge", "--config", str(cfg), "--refit-heads", str(tmp_path / "o")])
    assert res.exit_code == 2 and "given with --config" in res.output
    assert not (tmp_path / "o").exists()
