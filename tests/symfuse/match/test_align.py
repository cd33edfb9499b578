"""One alignment path: every driver writes one report about what it WROTE, and a corrupted write is never published."""

import importlib
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import symfuse.cli.match  # noqa: F401  (registers the commands)
from symfuse.cli import app
from symfuse.errors import UsageError
from symfuse.match import align_checkpoints, disguise_checkpoint, match_checkpoints, plan_alignment
from symfuse.match.align import FINDERS
from symfuse.match.report import COMMON_KEYS
from tests.cli.helpers import toy_dataset
from tests.tiny import save_tiny, save_tiny_text_classifier

PERMS = ["ffn-permutation", "head-permutation"]
# driver -> (family of the tiny model, kinds, whether it reads the toy dataset)
DRIVERS = {
    "weights": ("bert", ["rotation", "scaling", *PERMS], False),
    "activations": ("bert", PERMS, True),
    "ot": ("bert", ["ot"], False),
    "residual-orthogonal": ("gpt2", ["residual-orthogonal", "ffn-permutation"], False),
}


def _pair(tmp_path, family):
    """(source, anchor): the anchor and a disguised copy of it (same function, other weights)."""
    if family == "bert":
        anchor = save_tiny_text_classifier(tmp_path / "a", seed=1)
    else:
        anchor = save_tiny(tmp_path / "a", family, seed=1, head="lm", pad_token_id=0)
    return disguise_checkpoint(anchor, tmp_path / "d", seed=2, kinds=PERMS), anchor


def _align(tmp_path, driver, out):
    family, kinds, reads_data = DRIVERS[driver]
    src, anchor = _pair(tmp_path, family)
    data = str(toy_dataset(tmp_path / "toy")) if reads_data else None
    return align_checkpoints(src, anchor, out, kinds, data, max_examples=8, device="cpu")


@pytest.mark.parametrize("driver", list(DRIVERS))
def test_every_driver_writes_the_common_report_of_its_written_folder(tmp_path, driver):
    assert driver in FINDERS
    report = _align(tmp_path, driver, tmp_path / "m")
    assert list(report)[: len(COMMON_KEYS)] == list(COMMON_KEYS)
    assert report["driver"] == driver and report["verified"] is True and report["within_tolerance"] is True
    assert report["exact"] is True and isinstance(report["max_abs_logit_diff"], float)
    assert report["max_abs_logit_diff"] <= 1e-4
    assert report["tolerance"] == "1e-04 x max |output| (float32)" and report["dtype"] == "float32"
    assert report["checked"] == "the written folder, reloaded"
    assert isinstance(report["distance_before"], float) and report["distance_after"] <= report["distance_before"]
    assert json.loads((tmp_path / "m" / "symfuse_report.json").read_text()) == json.loads(json.dumps(report))


def _perturb_one_tensor(folder):
    """Add noise to one weight matrix of the first layer in the folder's checkpoint (a writer gone wrong).

    Noise, not a constant: a constant added to a matrix reading a LayerNorm's zero-mean output changes nothing.
    """
    file = next(f for f in sorted(folder.glob("*.safetensors")) if f.name.startswith("model"))
    weights = load_file(str(file))
    name = next(n for n, t in weights.items() if t.dim() == 2 and any(f"{s}0." in n for s in ("layer.", "h.")))
    weights[name] = weights[name] + 0.5 * torch.randn(weights[name].shape, generator=torch.Generator().manual_seed(0))
    save_file(weights, str(file), metadata={"format": "pt"})


@pytest.mark.parametrize("driver", list(DRIVERS))
def test_a_corrupted_write_fails_the_command_and_publishes_nothing(tmp_path, driver, monkeypatch):
    module, _, attr = FINDERS[driver].step.partition(":")
    step = getattr(importlib.import_module(module), attr)

    def corrupted(request, tmp):
        found = step(request, tmp)
        _perturb_one_tensor(tmp)
        return found

    monkeypatch.setattr(importlib.import_module(module), attr, corrupted)
    family, kinds, reads_data = DRIVERS[driver]
    src, anchor = _pair(tmp_path, family)
    data = ("--data", toy_dataset(tmp_path / "toy"), "--max-examples", 8) if reads_data else ()
    args = ["match", src, anchor, "--out", tmp_path / "m", "--symmetries", ",".join(kinds), *data, "--device", "cpu"]
    res = CliRunner().invoke(app, [str(a) for a in args])
    assert res.exit_code == 1, res.output
    assert "does not compute the source's function; nothing was published" in res.output
    assert not (tmp_path / "m").exists() and not list(tmp_path.glob("m.*")) and not list(tmp_path.glob(".m*"))


def test_verify_none_states_exact_from_the_transforms_and_says_it_did_not_check(tmp_path):
    src, anchor = _pair(tmp_path, "bert")
    report = match_checkpoints(src, anchor, tmp_path / "m", PERMS, verify="none")
    assert report["exact"] is True and report["verified"] is False
    assert report["max_abs_logit_diff"] is None and report["within_tolerance"] is None
    assert report["checked"].startswith("the transforms only")


def test_a_soft_alignment_is_measured_and_reported_inexact(tmp_path):
    src, anchor = _pair(tmp_path, "bert")
    report = align_checkpoints(src, anchor, tmp_path / "m", ["ot-soft"], device="cpu")
    assert report["exact"] is False and report["verified"] is True  # soft maps: never exact, measured all the same
    assert isinstance(report["max_abs_logit_diff"], float) and isinstance(report["within_tolerance"], bool)


@pytest.mark.parametrize(
    ("kinds", "data", "refine", "expect"),
    [
        (["ot", "ot-soft"], None, 0, "--symmetries: ot, ot-soft do not combine — OT fusion takes ONE of"),
        (["ot", "ffn-permutation"], None, 0, "--symmetries: ot, ffn-permutation do not combine"),
        (["ot", "residual-orthogonal"], None, 0, "--symmetries: ot, residual-orthogonal do not combine"),
        (["ot-acts"], None, 0, "--symmetries: ot-acts aligns by activations — give --data DATASET"),
        (["ot"], "toy", 0, "--data: ot aligns by weights and reads no data — use ot-acts"),
        (["residual-permutation"], None, 0, "--symmetries: residual-permutation is found from activations — give"),
        (["ffn-permutation"], None, 5, "--refine: refines residual-orthogonal's map on data — add"),
        (["residual-orthogonal"], None, 5, "--refine: refines residual-orthogonal's map on data — add"),
        (["rotation", "bogus"], None, 0, "--symmetries: unknown symmetries 'bogus'"),
    ],
)
def test_plan_refusals_are_one_line(kinds, data, refine, expect):
    with pytest.raises(UsageError) as err:
        plan_alignment(kinds, data, refine)
    assert str(err.value).startswith(expect) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("kinds", "data", "driver", "inner"),
    [
        (["rotation", "scaling"], None, "weights", ("rotation", "scaling")),
        (["ffn-permutation"], "toy", "activations", ("ffn-permutation",)),
        (["ot-acts", "rotation"], "toy", "ot", ("rotation",)),
        (["residual-orthogonal", "ffn-permutation"], "toy", "residual-orthogonal", ("ffn-permutation",)),
    ],
)
def test_the_plan_picks_one_driver(kinds, data, driver, inner):
    plan = plan_alignment(kinds, data)
    assert (plan.driver, plan.inner) == (driver, inner)


def test_report_tolerance_names_the_stored_dtype():
    from symfuse.match.report import tolerance_text

    assert tolerance_text(torch.bfloat16) == "2e-02 x max |output| (bfloat16)"


def test_a_new_finder_plugs_in_ahead_of_the_catch_all():
    from symfuse.match.align import Finder, register_finder

    order = list(FINDERS)
    toy = Finder("toy", lambda kinds, _: list(kinds) == ["scaling"], lambda *_: {"x": 1}, tuple, "tests:nothing")
    try:
        register_finder(toy, before="weights")
        assert list(FINDERS) == [*order[:-1], "toy", "weights"]
        plan = plan_alignment(["scaling"])
        assert (plan.driver, plan.options) == ("toy", {"x": 1})
        assert plan_alignment(["rotation"]).driver == "weights"
    finally:
        FINDERS.unregister("toy")
    assert list(FINDERS) == order
