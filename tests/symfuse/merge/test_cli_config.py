"""``symfuse merge --config merge.yaml OUT``: one YAML file gives the same merge as the flags, bit for bit."""

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import symfuse.cli.commands  # noqa: F401  (registers the commands)
from symfuse.cli import app
from tests.tiny import save_tiny


def _run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    return [save_tiny(d / n, "bert", seed=s) for n, s in (("base", 0), ("a", 1), ("b", 2), ("c", 3))]


def _same(x, y):
    a, b = load_file(x / "model.safetensors"), load_file(y / "model.safetensors")
    assert a.keys() == b.keys()
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("out_flag", [False, True])
def test_yaml_merge_equals_the_flag_merge_bitwise(models, tmp_path, out_flag):
    base, a, b, c = models
    cfg = tmp_path / "merge.yaml"
    cfg.write_text(
        f"strategy: ties\nmodels: [{a}, {b}, {c}]\nbase: {base}\nweights: [1, 2, 0.5]\n"
        "params:\n  density: 0.5\n  lam: 0.8\n"
    )
    flags = ["merge", "--strategy", "ties", "--models", a, b, c, "--base", base, "--weights", 1, 2, 0.5]
    r = _run(*flags, "--density", 0.5, "--lam", 0.8, "--out", tmp_path / "flags")
    assert r.exit_code == 0, r.output
    out = ["--out", tmp_path / "yaml"] if out_flag else [tmp_path / "yaml"]
    r = _run("merge", "--config", cfg, *out)
    assert r.exit_code == 0, r.output
    assert _same(tmp_path / "flags", tmp_path / "yaml")
    r = _run("merge", "--config", cfg, tmp_path / "other", "--overwrite")  # --overwrite is not a merge setting
    assert r.exit_code == 0, r.output
    # and the parameters are used: another density gives another merge
    cfg.write_text(cfg.read_text().replace("density: 0.5", "density: 0.2"))
    assert _run("merge", "--config", cfg, tmp_path / "d02").exit_code == 0
    assert not _same(tmp_path / "flags", tmp_path / "d02")


BAD = [
    ("unknown-key", "strategy: simple\nmodels: [{a}, {b}]\nmodles: [x]\n", "modles"),
    ("unknown-param", "strategy: simple\nmodels: [{a}, {b}]\nparams: {{alhpa: 0.5}}\n", "params.alhpa"),
    ("retired-param", "strategy: regmean\nmodels: [{a}, {b}]\nparams: {{linalg: scipy}}\n", "params.linalg: no longer"),
    ("wrong-type", "strategy: simple\nmodels: [{a}, {b}]\nweights: [1, heavy]\n", "weights.1"),
    ("bad-strategy", "strategy: nosuch\nmodels: [{a}, {b}]\n", "strategy"),
    ("one-model", "strategy: simple\nmodels: [{a}]\n", "models"),
    ("no-strategy", "models: [{a}, {b}]\n", "strategy"),
    ("range", "strategy: ties\nbase: {a}\nmodels: [{a}, {b}]\nparams: {{density: 1.5}}\n", "params.density"),
    ("not-yaml", "strategy: [simple\n", "line"),
    ("not-a-mapping", "- simple\n", "mapping"),
    ("unused-param", "strategy: simple\nmodels: [{a}, {b}]\nparams: {{alpha: 0.5}}\n", "alpha"),
    # it said "not a parameter" with nowhere to go
    (
        "weights-as-param",
        "strategy: simple\nmodels: [{a}, {b}]\nparams: {{weights: [3, 1]}}\n",
        "params.weights: the model weights are not a strategy parameter — give them as --weights wA wB",
    ),
    ("missing-model", "strategy: simple\nmodels: [{a}, /nonexistent/model]\n", "/nonexistent/model"),
    ("duplicate-key", "strategy: simple\nmodels: [{a}, {b}]\nstrategy: ties\n", "line 3: key 'strategy' given twice"),
    (
        "duplicate-mergekit-key",
        "merge_method: linear\nmodels:\n  - model: {a}\n  - model: {b}\nmerge_method: ties\n",
        "line 5: key 'merge_method' given twice",
    ),
    (
        "duplicate-nested-key",
        "strategy: ties\nbase: {a}\nmodels: [{a}, {b}]\nparams:\n  density: 0.5\n  density: 0.2\n",
        "line 6: key 'density' given twice",
    ),
]


@pytest.mark.parametrize(("case", "text", "key"), BAD, ids=[b[0] for b in BAD])
def test_bad_yaml_is_one_line_naming_the_file_and_the_key(models, tmp_path, case, text, key):
    _, a, b, _ = models
    cfg = tmp_path / "merge.yaml"
    cfg.write_text(text.format(a=a, b=b))
    r = _run("merge", "--config", cfg, tmp_path / "out")
    lines = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert r.exit_code == 2 and len(lines) == 1, r.output
    assert str(cfg) in lines[0] and key in lines[0], lines[0]
    assert "Traceback" not in r.output
    assert not (tmp_path / "out").exists()


def test_missing_config_file_and_flags_alongside_are_refused(models, tmp_path):
    _, a, b, _ = models
    r = _run("merge", "--config", tmp_path / "nope.yaml", tmp_path / "out")
    assert r.exit_code == 2 and "nope.yaml" in r.output and "--config" in r.output, r.output
    cfg = tmp_path / "merge.yaml"
    cfg.write_text(f"strategy: simple\nmodels: [{a}, {b}]\n")
    r = _run("merge", "--config", cfg, tmp_path / "out", "--strategy", "ties", "--weights", 1, 2)
    assert r.exit_code == 2 and "--strategy, --weights" in r.output and "given with --config" in r.output, r.output
    r = _run("merge", "--config", cfg, tmp_path / "out", "--out", tmp_path / "out2")
    assert r.exit_code == 2 and "OUT" in r.output, r.output
    r = _run("merge", "--config", cfg)
    assert r.exit_code == 2 and "--out" in r.output, r.output
    assert not (tmp_path / "out").exists() and not (tmp_path / "out2").exists()
