"""``symfuse match-many``: K disguised copies aligned to one anchor, function kept, the disguise recovered."""

import json

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import symfuse.cli.commands  # noqa: F401  (registers the commands)
from symfuse.cli import app
from symfuse.outputs import MARKER
from tests.tiny import save_tiny

SYM = "rotation,scaling,ffn-permutation,head-permutation"


def _run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture
def three(tmp_path):
    """A tiny model, a disguised copy of it, and an unrelated model."""
    a = save_tiny(tmp_path / "a", "bert", seed=1, head="seq")
    r = _run("disguise", a, "--out", tmp_path / "b", "--seed", 3)
    assert r.exit_code == 0, r.output
    c = save_tiny(tmp_path / "c", "bert", seed=2, head="seq")
    return a, tmp_path / "b", c


def _close(x: dict, y: dict, tol: float) -> bool:
    return all(torch.allclose(x[k].double(), y[k].double(), atol=tol) for k in x)


def test_named_anchor_recovers_the_disguised_copy_and_keeps_functions(three, tmp_path):
    a, b, c = three
    out = tmp_path / "aligned"
    r = _run("match-many", a, b, c, "--anchor", "a", "--symmetries", SYM, "--out", out)
    assert r.exit_code == 0, r.output
    report = json.loads((out / "symfuse_many_report.json").read_text())
    assert report["anchor"] == str(a) and [m["out"] for m in report["models"]] == ["a", "b", "c"]
    for m in report["models"]:
        assert m["max_abs_logit_diff"] <= 1e-4 and m["exact"] and m["within_tolerance"], m  # functions kept
    by = {m["out"]: m for m in report["models"]}
    assert by["b"]["distance_before"] > 1 and by["b"]["distance_after"] < 1e-4  # the disguise is undone
    assert by["c"]["distance_after"] < by["c"]["distance_before"]
    # the disguised copy's aligned weights equal the anchor's, tensor by tensor
    assert _close(load_file(out / "b" / "model.safetensors"), load_file(a / "model.safetensors"), 1e-4)
    assert _close(load_file(out / "a" / "model.safetensors"), load_file(a / "model.safetensors"), 0)
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "a", "b", "c", "symfuse_many_report.json"]  # no temp
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "aligned", "b", "c"]


@pytest.mark.parametrize("anchor", ["closest", "barycenter"])
def test_closest_and_barycenter_keep_functions(three, tmp_path, anchor):
    out = tmp_path / "aligned"
    r = _run("match-many", *three, "--anchor", anchor, "--symmetries", SYM, "--out", out)
    assert r.exit_code == 0, r.output
    report = json.loads((out / "symfuse_many_report.json").read_text())
    assert all(m["max_abs_logit_diff"] <= 1e-4 for m in report["models"]), report
    moved = [(m["distance_before"], m["distance_after"]) for m in report["models"]]  # to the anchor / barycenter
    assert all(after <= before + 1e-6 for before, after in moved) and any(a < b for b, a in moved), moved
    wa = load_file(out / "a" / "model.safetensors")
    wb = load_file(out / "b" / "model.safetensors")
    # a and its disguised copy end up in the same basis whatever the anchor
    assert _close(wa, wb, 1e-3)


def test_out_exists_is_refused_and_left_alone(three, tmp_path):
    out = tmp_path / "aligned"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    r = _run("match-many", *three, "--out", out)
    assert r.exit_code == 2 and "aligned" in r.output
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_two_models_with_one_folder_name_need_the_anchor_by_path_and_keep_their_own_outputs(three, tmp_path):
    a, b, _ = three
    other = tmp_path / "other"
    other.mkdir()
    b = b.rename(other / "a")  # the disguised copy, also in a folder named a
    out = tmp_path / "aligned"
    r = _run("match-many", a, b, "--anchor", "a", "--symmetries", SYM, "--out", out)
    lines = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert r.exit_code == 2 and len(lines) == 1, r.output
    assert lines[0] == (
        f"error: --anchor: 'a' names 2 models ({a}, {b}) — give the anchor by its path, e.g. --anchor {a}"
    )
    assert not out.exists()
    r = _run("match-many", a, b, "--anchor", b, "--symmetries", SYM, "--out", out)
    assert r.exit_code == 0, r.output
    report = json.loads((out / "symfuse_many_report.json").read_text())
    assert report["anchor"] == str(b) and [m["out"] for m in report["models"]] == ["0-a", "1-a"]
    assert _close(load_file(out / "1-a" / "model.safetensors"), load_file(b / "model.safetensors"), 0)  # the anchor
    assert _close(load_file(out / "0-a" / "model.safetensors"), load_file(b / "model.safetensors"), 1e-4)
    assert not _close(load_file(a / "model.safetensors"), load_file(b / "model.safetensors"), 1e-2)


def test_folder_names_that_differ_only_in_case_get_their_own_outputs(three, tmp_path):
    a, b, _ = three
    upper = b.rename(tmp_path / "A")  # one folder on a case-insensitive file system (macOS, Windows)
    out = tmp_path / "aligned"
    r = _run("match-many", a, upper, "--anchor", "0-a", "--symmetries", SYM, "--out", out)
    assert r.exit_code == 0, r.output
    report = json.loads((out / "symfuse_many_report.json").read_text())
    assert report["anchor"] == str(a) and [m["out"] for m in report["models"]] == ["0-a", "1-A"]


def test_an_anchor_given_as_another_spelling_of_a_models_path_is_that_model(tmp_path, monkeypatch):
    """``--anchor ./m/b`` (or its absolute path, or a trailing slash) for the model ``m/b`` was "not one of the
    models (a, b)"."""
    from symfuse.cli.match_many import anchor_index

    for name in ("a", "b"):
        (tmp_path / "m" / name).mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    models = ["m/a", "m/b"]
    for spelt in ("./m/b", str(tmp_path / "m" / "b"), "m/b/", "m/../m/b", "b", "m/b"):
        assert anchor_index(spelt, models, ["a", "b"]) == 1, spelt


def test_soft_ot_is_reported_not_exact_in_the_summary(three, tmp_path):
    """The summary had no "exact" key: only each model's own report said a soft plan changes the function."""
    a, b, _ = three
    r = _run("match-many", a, b, "--anchor", "a", "--symmetries", "ot-soft", "--out", tmp_path / "soft")
    assert r.exit_code == 0, r.output
    rows = json.loads((tmp_path / "soft" / "symfuse_many_report.json").read_text())["models"]
    assert [(m["out"], m["exact"]) for m in rows] == [("a", True), ("b", False)]


def test_a_model_folder_named_like_the_report_gets_its_own_output(three, tmp_path):
    """Its folder collided with the report written into OUT: an error after the work, naming a hidden path."""
    import shutil

    a, b, _ = three
    clash = shutil.copytree(b, tmp_path / "x" / "symfuse_many_report.json")
    r = _run("match-many", a, clash, "--anchor", a, "--symmetries", SYM, "--out", tmp_path / "out")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "out" / "1-symfuse_many_report.json" / "model.safetensors").is_file()
    assert json.loads((tmp_path / "out" / "symfuse_many_report.json").read_text())["models"]


def test_barycenter_options_without_a_barycenter_are_refused(three, tmp_path):
    """--max-iter / --tol were accepted and ignored with a named or the closest anchor (the report said 1 iteration)."""
    a, b, _ = three
    r = _run("match-many", a, b, "--max-iter", 50, "--tol", 0.9, "--out", tmp_path / "out")
    assert r.exit_code == 2 and "--max-iter / --tol: read only with --anchor barycenter" in r.output
    assert not (tmp_path / "out").exists()
