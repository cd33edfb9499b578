"""The registries' "two files" check: a toy merge strategy and a toy symmetry kind, each defined in THIS module and
registered with one line, work through the public paths (run config, ``symfuse merge``, merge.yaml, matching,
``disguise``) exactly like the built-in ones; unknown names are refused in one line listing the choices."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
import torch
import transformers
from pydantic import Field, ValidationError
from safetensors.torch import load_file
from typer.testing import CliRunner

from symfuse.config import RunConfig
from symfuse.errors import UnknownChoiceError
from symfuse.match import disguise_checkpoint, match_checkpoints, match_module_weights
from symfuse.match.weights import module_distance
from symfuse.merge import MERGERS, MergeParams, Merger, TensorInputs, merge_checkpoints
from symfuse.merge.registry import register_merger, unregister_merger
from symfuse.stats import StatsFile, collect_fisher, collect_gram, save_stats, transform_stats
from symfuse.symmetry import ModuleTransform, Transform, load_transforms, register_transform
from symfuse.symmetry.follow import fisher_of_permutation
from symfuse.symmetry.registry import SymmetryKind, kind_names, register_kind, unregister_kind
from tests.tiny import random_inputs, save_tiny


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
        "unknown merge strategy 'nosuch' — choose from simple, fisher, regmean, regmean++, task-arithmetic, ties, "
        "dare, breadcrumbs, breadcrumbs-ties, della, della-linear, sce, slerp, nuslerp, multislerp, karcher, "
        "model-stock, nearswap, arcee-fusion, passthrough, pick-one"
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


# -------------------------------------------------------------------------------------------- a toy symmetry kind
@register_transform  # its transform part, loadable from a transforms file by name
@dataclass(frozen=True, eq=False)
class FFNShift(Transform):
    """Cyclic shift of the FFN's hidden neurons: new neuron ``j`` = old neuron ``(j + shift) mod d_ffn`` (exact)."""

    shift: torch.Tensor  # (1,) int64
    name: ClassVar[str] = "ffn_shift"

    def index(self, n: int) -> torch.Tensor:
        return (torch.arange(n) + int(self.shift)) % n

    def apply(self, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out, idx = dict(weights), self.index(weights["up"].shape[0])
        for role in ("up", "up_bias", "gate", "gate_bias"):
            if role in weights:
                out[role] = weights[role][idx]
        out["down"] = weights["down"][:, idx]
        return out

    def inverse(self) -> Transform:
        return FFNShift(-self.shift)

    def apply_to_gram(self, role: str, gram: torch.Tensor) -> torch.Tensor:
        if role != "down":
            return gram
        idx = self.index(gram.shape[-1])
        return gram[..., idx, :][..., :, idx]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"shift": self.shift}


def draw_shift(ref, geo, generator, log_scale) -> tuple[Transform, ...]:
    return (FFNShift(torch.randint(1, geo.d_ffn, (1,), generator=generator)),)


def find_shift(src, anc, geo, symmetries, key="", timings=None) -> ModuleTransform:
    """The shift bringing the source's FFN closest to the anchor's (every shift tried)."""
    n = src["up"].shape[0]
    best = min(range(n), key=lambda k: module_distance(FFNShift(torch.tensor([k])).apply(src), anc))
    return ModuleTransform(key, (FFNShift(torch.tensor([best])),))


SHIFT = SymmetryKind(
    "ffn-shift", "ffn", ("ffn_shift",), stage=1, draw=draw_shift, weights=find_shift,
    fisher="symfuse.symmetry.follow:fisher_of_permutation",
)  # fmt: skip


@pytest.fixture
def ffn_shift():
    register_kind(SHIFT)  # the one registration line
    yield SHIFT.name
    unregister_kind(SHIFT.name)


@pytest.fixture(scope="module")
def seq_model(tmp_path_factory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("seq") / "src", "bert", seed=0, head="seq")


def _logits(folder: Path, inputs) -> torch.Tensor:
    model = transformers.AutoModelForSequenceClassification.from_pretrained(str(folder)).eval()
    with torch.no_grad():
        return model(**inputs).logits


def test_a_registered_kind_disguises_and_is_matched_back(ffn_shift, seq_model, tmp_path):
    inputs = random_inputs(transformers.AutoModel.from_pretrained(str(seq_model)), batch=3, seq=7, seed=4)
    disguised = disguise_checkpoint(seq_model, tmp_path / "d", seed=3, kinds=[ffn_shift])
    parts = [p for t in load_transforms(disguised / "transforms.safetensors").values() for p in t.parts]
    assert parts and all(isinstance(p, FFNShift) and int(p.shift) > 0 for p in parts)
    before, after = load_file(seq_model / "model.safetensors"), load_file(disguised / "model.safetensors")
    key = "bert.encoder.layer.0.intermediate.dense.weight"
    assert not torch.equal(before[key], after[key])  # the weights moved ...
    torch.testing.assert_close(_logits(disguised, inputs), _logits(seq_model, inputs))  # ... the function did not

    report = match_checkpoints(disguised, seq_model, tmp_path / "m", symmetries=[ffn_shift])
    assert report["distance_before"] > 1.0 and report["distance_after"] < 1e-5
    matched = load_file(tmp_path / "m" / "model.safetensors")
    assert all(torch.allclose(matched[k], before[k], atol=1e-6) for k in before)

    # one finder per module kind, in stage order: a full permutation first, then the shift (found as 0 after it)
    ref_w = {"up": after[key], "down": after["bert.encoder.layer.0.output.dense.weight"]}
    anc_w = {"up": before[key], "down": before["bert.encoder.layer.0.output.dense.weight"]}
    t = match_module_weights("L00.ffn", ref_w, anc_w, None, ["ffn-permutation", ffn_shift])
    assert [p.name for p in t.parts] == ["ffn_perm", "ffn_shift"] and int(t.parts[1].shift) == 0
    assert module_distance(t.apply(ref_w), anc_w) < 1e-6


def test_statistics_follow_a_registered_kind(ffn_shift, seq_model, tmp_path):
    disguised = disguise_checkpoint(seq_model, tmp_path / "d", seed=5, kinds=[ffn_shift])
    model, moved_model = (transformers.AutoModelForSequenceClassification.from_pretrained(str(p)).eval()
                          for p in (seq_model, disguised))  # fmt: skip
    batches = []
    for s in range(2):
        b = random_inputs(model, batch=4, seq=7, seed=s)
        b["labels"] = torch.tensor([0, 1, 1, s])
        batches.append(b)
    gram = collect_gram(model, batches, progress=False)
    save_stats(gram.grams, tmp_path / "gram.safetensors", {"kind": "gram", "conv1d": gram.conv1d})
    fisher = collect_fisher(model, batches, progress=False).fisher
    save_stats(fisher, tmp_path / "fisher.safetensors", {"kind": "fisher"})
    tfile = disguised / "transforms.safetensors"
    for kind, recollected in (
        ("gram", collect_gram(moved_model, batches, progress=False).grams),
        ("fisher", collect_fisher(moved_model, batches, progress=False).fisher),
    ):
        out = transform_stats(tmp_path / f"{kind}.safetensors", tfile, seq_model, tmp_path / f"{kind}_t.safetensors")
        assert out is not None, kind
        moved = StatsFile(out)
        for key, value in recollected.items():
            torch.testing.assert_close(moved.get(key).to(value.dtype), value, rtol=2e-3, atol=1e-7, msg=key)
    key = "bert.encoder.layer.0.output.dense"  # the down projection's input moved
    assert not torch.allclose(gram.grams[key], StatsFile(tmp_path / "gram_t.safetensors").get(key))


def test_a_registered_kind_is_a_choice_of_the_config_and_the_cli(ffn_shift, seq_model, tmp_path):
    assert ffn_shift in kind_names("weights") and ffn_shift in kind_names("draw")
    cfg = RunConfig.demo(symmetries=["rotation", ffn_shift])
    assert cfg.symmetries == ["rotation", ffn_shift]
    assert ffn_shift in RunConfig.model_json_schema()["properties"]["symmetries"]["items"]["enum"]
    res = _cli("disguise", seq_model, "--out", tmp_path / "d", "--kinds", ffn_shift, "--seed", 1)
    assert res.exit_code == 0, res.output
    res = _cli("match", tmp_path / "d", seq_model, "--out", tmp_path / "m", "--symmetries", ffn_shift)
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "m" / "symfuse_report.json").read_text())["distance_after"] < 1e-5


def test_unknown_kinds_are_refused_in_one_line_listing_the_choices(ffn_shift, seq_model, tmp_path):
    with pytest.raises(UnknownChoiceError) as err:
        disguise_checkpoint(seq_model, tmp_path / "d", kinds=["rotation", "nosuch"])
    assert str(err.value) == (
        "unknown disguise kinds 'nosuch' — choose from rotation, scaling, ffn-permutation, head-permutation, "
        "residual-permutation, residual-orthogonal, head-linear, ffn-shift"
    )
    with pytest.raises(
        UnknownChoiceError, match=r"unknown symmetries 'residual-permutation' — choose from .*ffn-shift"
    ):
        match_checkpoints(seq_model, seq_model, tmp_path / "m", symmetries=["residual-permutation"])
    with pytest.raises(ValidationError, match=r"unknown symmetries \['nosuch'\]: choose from \[.*'ffn-shift'\]"):
        RunConfig.demo(symmetries=["nosuch"])
    res = _cli("disguise", seq_model, "--out", tmp_path / "d", "--kinds", "nosuch")
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and "unknown kinds 'nosuch'" in lines[0] and "ffn-shift" in lines[0]
    assert not (tmp_path / "d").exists() and not (tmp_path / "m").exists()


def test_a_kind_is_registered_once_and_shares_parts_only_when_statistics_agree(ffn_shift):
    with pytest.raises(ValueError, match="already registered"):
        register_kind(SHIFT)
    # another finder of FFN permutations may share the part when statistics follow it the same way ...
    register_kind(SymmetryKind("other", "ffn", ("ffn_perm",), fisher=fisher_of_permutation))
    unregister_kind("other")
    # ... not when they would follow it differently
    with pytest.raises(ValueError, match=r"parts \['ffn_perm'\] also come from 'ffn-permutation', whose statistics"):
        register_kind(SymmetryKind("other", "ffn", ("ffn_perm",)))
    assert "other" not in kind_names()
    with pytest.raises(ValueError, match="only an exact kind may have a random draw"):
        SymmetryKind("inexact", "ffn", ("x",), exact=False, draw=draw_shift)


def test_a_kind_may_act_on_both_modules_and_exclude_others(seq_model, tmp_path):
    seen = []

    def find_nothing(src, anc, geo, symmetries, key="", timings=None) -> ModuleTransform:
        seen.append(key)
        return ModuleTransform(key, ())

    kind = SymmetryKind("align-all", ("attn", "ffn"), ("nothing",), weights=find_nothing, excludes=("ffn-permutation",))
    register_kind(kind)
    try:
        report = match_checkpoints(seq_model, seq_model, tmp_path / "m", symmetries=["rotation", "align-all"])
        assert sorted(seen) == ["L00.attn", "L00.ffn", "L01.attn", "L01.ffn"] and report["distance_after"] < 1e-6
        with pytest.raises(ValueError, match="symmetries ffn-permutation and align-all exclude each other"):
            match_checkpoints(seq_model, seq_model, tmp_path / "x", symmetries=["ffn-permutation", "align-all"])
        with pytest.raises(ValidationError, match="exclude each other"):
            RunConfig.demo(symmetries=["align-all", "ffn-permutation"])
        res = _cli(
            "match-many", seq_model, seq_model, "--out", tmp_path / "x", "--symmetries", "align-all,ffn-permutation"
        )
        lines = [ln for ln in res.output.splitlines() if ln.strip()]
        assert res.exit_code == 2 and len(lines) == 1 and "--symmetries: symmetries align-all and ffn-perm" in lines[0]
        assert not (tmp_path / "x").exists()
    finally:
        unregister_kind("align-all")
