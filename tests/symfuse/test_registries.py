"""The registries' "two files" check: a toy merge strategy and a toy symmetry kind, each defined in THIS module and
registered with one line, work through the public paths (run config, ``symfuse merge``, merge.yaml, matching,
``disguise``) exactly like the built-in ones; unknown names are refused in one line listing the choices."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pydantic import Field, ValidationError
from safetensors.torch import load_file
from typer.testing import CliRunner

from symfuse.config import RunConfig
from symfuse.errors import UnknownChoiceError
from symfuse.merge import MERGERS, MergeParams, Merger, TensorInputs, merge_checkpoints
from symfuse.merge.registry import register_merger, unregister_merger
from tests.tiny import save_tiny


# ------------------------------------------------------------------------------------------ a toy merger
class PickOneParams(MergeParams):
    """Which model's tensors win."""

    index: int = Field(default=0, ge=0)


class PickOneMerger(Merger):
    """Every tensor is model ``index``'s (a merge that is trivially checkable)."""

    name = "pick-one"
    Params = PickOneParams

    def merge_tensor(self, t: TensorInputs) -> torch.Tensor:
        """A copy of model ``index``'s tensor."""
        return t.tensors[self.params.index].clone()  # type: ignore[attr-defined]


@pytest.fixture
def pick_one():
    register_merger(PickOneMerger)  # the one registration line
    yield PickOneMerger.name
    unregister_merger(PickOneMerger.name)


@pytest.fixture(scope="module")
def two_models(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("models")
    return save_tiny(d / "a", "bert", seed=1), save_tiny(d / "b", "bert", seed=2)


def _cli(*args: object):
    import symfuse.cli.commands  # noqa: F401  (registers the commands)
    from symfuse.cli import app

    return CliRunner().invoke(app, [str(a) for a in args])


def test_a_registered_merger_is_a_run_config_choice_with_typed_params(pick_one):
    cfg = RunConfig.demo(strategies=["simple", pick_one], merge_params={pick_one: {"index": 1}})
    assert cfg.strategy_params(pick_one) == {"index": 1}
    assert pick_one in RunConfig.model_json_schema()["properties"]["strategies"]["items"]["enum"]
    with pytest.raises(ValidationError, match=r"merge_params\.pick-one\.index: Input should be greater than"):
        RunConfig.demo(strategies=[pick_one], merge_params={pick_one: {"index": -1}})
    with pytest.raises(ValidationError, match=r"merge_params\.pick-one\.indx: not a parameter of strategy pick-one"):
        RunConfig.demo(strategies=[pick_one], merge_params={pick_one: {"indx": 1}})


def test_a_registered_merger_merges_through_the_cli_flags_and_merge_yaml(pick_one, two_models, tmp_path):
    a, b = two_models
    res = _cli("merge", "--strategy", pick_one, "--param", "index=1", "--models", a, b, "--out", tmp_path / "m")
    assert res.exit_code == 0, res.output
    merged, second = load_file(tmp_path / "m" / "model.safetensors"), load_file(b / "model.safetensors")
    assert merged.keys() == second.keys() and all(torch.equal(merged[k], second[k]) for k in merged)
    assert json.loads((tmp_path / "m" / "symfuse_report.json").read_text())["params"]["index"] == 1

    spec = tmp_path / "merge.yaml"
    spec.write_text(f"strategy: {pick_one}\nmodels: [{a}, {b}]\nparams: {{index: 0}}\n")
    res = _cli("merge", "--config", spec, tmp_path / "m0")
    assert res.exit_code == 0, res.output
    merged, first = load_file(tmp_path / "m0" / "model.safetensors"), load_file(a / "model.safetensors")
    assert all(torch.equal(merged[k], first[k]) for k in merged)

    res = _cli("merge", "--strategy", pick_one, "--param", "index=-1", "--models", a, b, "--out", tmp_path / "bad")
    assert res.exit_code == 2 and not (tmp_path / "bad").exists()
    assert "--param index: Input should be greater than or equal to 0" in res.output
    res = _cli("merge", "--strategy", pick_one, "--alpha", "0.5", "--models", a, b, "--out", tmp_path / "bad")
    assert res.exit_code == 2 and "--alpha: not a parameter of --strategy pick-one" in res.output


def test_the_library_merges_with_a_registered_merger(pick_one, two_models, tmp_path):
    a, b = two_models
    out = merge_checkpoints(pick_one, [a, b], tmp_path / "m", index=1)
    merged, second = load_file(out / "model.safetensors"), load_file(b / "model.safetensors")
    assert all(torch.equal(merged[k], second[k]) for k in merged)


def test_unknown_strategies_are_refused_in_one_line_listing_the_choices(pick_one, two_models, tmp_path):
    with pytest.raises(UnknownChoiceError) as err:
        merge_checkpoints("nosuch", list(two_models), tmp_path / "m")
    assert str(err.value) == (
        "unknown merge strategy 'nosuch' — choose from simple, fisher, regmean, task-arithmetic, ties, dare, pick-one"
    )
    with pytest.raises(ValidationError, match=r"unknown merge strategies \['nosuch'\]: choose from \[.*'pick-one'\]"):
        RunConfig.demo(strategies=["nosuch"])
    a, b = two_models
    res = _cli("merge", "--strategy", "nosuch", "--models", a, b, "--out", tmp_path / "m")
    assert res.exit_code == 2 and not (tmp_path / "m").exists()
    error = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(error) == 1 and "--strategy: unknown value 'nosuch'" in error[0] and "pick-one" in error[0]


def test_unregistering_removes_the_choice():
    register_merger(PickOneMerger)
    assert "pick-one" in MERGERS and MERGERS["pick-one"] is PickOneMerger
    with pytest.raises(ValueError, match="already registered"):
        register_merger(PickOneMerger)
    unregister_merger("pick-one")
    assert "pick-one" not in MERGERS
    with pytest.raises(ValidationError, match="unknown merge strategies"):
        RunConfig.demo(strategies=["pick-one"])
