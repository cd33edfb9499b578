"""Merging PEFT LoRA adapters: the identity case, basis invariance, PEFT loading, the stated formulas."""

from __future__ import annotations

import json
import re

import pytest
import torch
import transformers as T
from peft import PeftModel

from symfuse.errors import CheckpointError, UsageError
from symfuse.lora import merge_adapters, read_adapter
from symfuse.merge.task_vectors import ties_combine
from tests.symfuse.lora.helpers import edited_copy, effective_weights, make_adapter, rebased, tiny_base
from tests.tiny import random_inputs


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """A tiny Llama and adapters of it: two plain, one rsLoRA, two DoRA, one on fewer modules, one rebased."""
    d = tmp_path_factory.mktemp("lora")
    base = tiny_base(d / "base")
    z = {"base": base, "dir": d}
    z["a1"] = make_adapter(base, d / "a1", seed=1)
    z["a2"] = make_adapter(base, d / "a2", seed=2)
    z["rs"] = make_adapter(base, d / "rs", seed=3, r=2, alpha=6, use_rslora=True)
    z["d1"] = make_adapter(base, d / "d1", seed=4, use_dora=True)
    z["d2"] = make_adapter(base, d / "d2", seed=5, use_dora=True)
    z["q"] = make_adapter(base, d / "q", seed=6, r=2, targets=["q_proj"])
    z["a1m"] = rebased(z["a1"], d / "a1m")
    return z


def _deltas(folder) -> dict[str, torch.Tensor]:
    return {k: m.delta() for k, m in read_adapter(folder).modules.items()}


def _rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x - y).norm() / y.norm())


def _max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(_rel(a[k], b[k]) for k in b)


def _effective_diff(zoo, merged, original) -> float:
    """Largest relative difference of the adapted weights, each folder loaded and merged by PEFT."""
    got, want = effective_weights(zoo["base"], merged), effective_weights(zoo["base"], original)
    base = effective_weights(zoo["base"], None)
    changed = [k for k in want if not torch.equal(want[k], base[k])]
    assert changed  # the adapter really changes the model
    return max(_rel(got[k], want[k]) for k in changed)


def test_rebased_helper_keeps_every_update_and_changes_every_factor(zoo):
    a, m = read_adapter(zoo["a1"]), read_adapter(zoo["a1m"])
    assert _max_rel(_deltas(zoo["a1m"]), _deltas(zoo["a1"])) < 1e-6
    assert all(_rel(m.modules[k].B.double(), a.modules[k].B.double()) > 0.1 for k in a.modules)


@pytest.mark.parametrize("basis", ["aligned", "full", "naive"])
@pytest.mark.parametrize("kind", ["a1", "rs", "d1"])
def test_one_adapter_with_weight_1_gives_back_its_weights(zoo, kind, basis, tmp_path):
    """PEFT issue #3761's case: merging one adapter with weight 1 returns it (plain LoRA, rsLoRA, DoRA)."""
    out = merge_adapters([zoo[kind]], tmp_path / "out", "task-arithmetic", basis=basis, base=zoo["base"],
                         weights=[1.0])  # fmt: skip
    assert _effective_diff(zoo, out, zoo[kind]) < 1e-6  # fp32 rounding of the re-factored B, A
    if kind != "d1":  # DoRA's update is not B A alone (see the DoRA tests)
        assert _max_rel(_deltas(out), _deltas(zoo[kind])) < 1e-6
    report = json.loads((out / "symfuse_report.json").read_text())
    assert report["truncation"]["max_relative_error"] < 1e-12 and report["basis"] == basis
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["use_dora"] == (kind == "d1") and not cfg["use_rslora"] and cfg["r"] == cfg["lora_alpha"]


@pytest.mark.parametrize("strategy", ["ties", "dare", "task-arithmetic"])
def test_aligned_and_full_merges_do_not_depend_on_the_factors_basis(zoo, strategy, tmp_path):
    """(B M, M^-1 A) for one input: aligned and full merges unchanged; the naive merge changes."""
    params = {"ties": {"density": 0.5}, "dare": {"drop": 0.5}}.get(strategy, {})  # dare's density: only with ties
    got = {}
    for basis in ("aligned", "full", "naive"):
        for name in ("a1", "a1m"):
            out = merge_adapters([zoo[name], zoo["a2"]], tmp_path / f"{basis}-{name}", strategy, basis=basis,
                                 weights=[0.7, 0.3], **params)  # fmt: skip
            got[basis, name] = _deltas(out)
        assert _max_rel(got[basis, "a1m"], got[basis, "a1"]) < 1e-5 or basis == "naive"
    assert _max_rel(got["naive", "a1m"], got["naive", "a1"]) > 0.05  # PEFT's way depends on the basis
    if strategy == "task-arithmetic":  # linear: aligned and full are both exactly sum_i w_i D_i
        d1, d2 = _deltas(zoo["a1"]), _deltas(zoo["a2"])
        want = {k: 0.7 * d1[k] + 0.3 * d2[k] for k in d1}
        assert _max_rel(got["aligned", "a1"], want) < 1e-6 and _max_rel(got["full", "a1"], want) < 1e-6
    else:  # TIES / DARE act on entries: the aligned (KnOTS) and full merges differ
        assert _max_rel(got["aligned", "a1"], got["full", "a1"]) > 0.01


def test_aligned_ties_is_knots_formula_and_loads_with_peft(zoo, tmp_path):
    """ΔW = U S ties(V_1, V_2)^T from the SVD of [D_1, D_2]; PEFT's model output is the base's with W + ΔW."""
    out = merge_adapters([zoo["a1"], zoo["q"]], tmp_path / "out", "ties", basis="aligned", density=0.5, lam=1.0)
    d1, d2 = _deltas(zoo["a1"]), _deltas(zoo["q"])
    want = {}
    for k, x in d1.items():
        y = d2.get(k, torch.zeros_like(x))  # a module the second adapter leaves alone: a zero update
        u, s, vt = torch.linalg.svd(torch.cat([x, y], dim=1), full_matrices=False)
        keep = s > 1e-10 * s[0]
        u, s, vt = u[:, keep], s[keep], vt[keep]
        v1, v2 = vt[:, : x.shape[1]], vt[:, x.shape[1] :]
        want[k] = u @ (s[:, None] * ties_combine([v1, v2], [0.5, 0.5], 0.5))  # TIES is odd: SVD signs cancel
    assert _max_rel(_deltas(out), want) < 1e-5
    base = T.AutoModelForCausalLM.from_pretrained(str(zoo["base"]))
    peft = PeftModel.from_pretrained(T.AutoModelForCausalLM.from_pretrained(str(zoo["base"])), str(out)).eval()
    with torch.no_grad():
        for k, dw in want.items():
            base.get_submodule(k).weight.add_(dw.float())
        x = random_inputs(base)
        assert torch.allclose(peft(**x).logits, base(**x).logits, atol=1e-5, rtol=1e-4)


def test_two_dora_adapters_merge_by_the_stated_formula(zoo, tmp_path):
    """D = sum c_i D_i, m = ||W|| + sum c_i (m_i - ||W||), W' = m (W + D) / ||W + D|| (rows), loaded by PEFT.

    Task arithmetic with lam 1 and weights 1 : 3 (normalised 0.25, 0.75, times K = 2): c = (0.5, 1.5).
    """
    out = merge_adapters([zoo["d1"], zoo["d2"]], tmp_path / "out", "task-arithmetic", weights=[1, 3], lam=1.0,
                         base=zoo["base"])  # fmt: skip
    base = effective_weights(zoo["base"], None)
    got = effective_weights(zoo["base"], out)
    ads = [read_adapter(zoo["d1"]), read_adapter(zoo["d2"])]
    c = (0.5, 1.5)
    for k in ads[0].modules:
        w = base[f"{k}.weight"]
        norm = w.norm(dim=1)
        d = sum(ci * ad.modules[k].delta() for ci, ad in zip(c, ads, strict=True))
        m = norm + sum(ci * (ad.modules[k].magnitude.double() - norm) for ci, ad in zip(c, ads, strict=True))
        want = (m / (w + d).norm(dim=1))[:, None] * (w + d)
        assert _rel(got[f"{k}.weight"], want) < 1e-6
        assert _rel(want, w) > 1e-3  # the merge really changed the weight


@pytest.mark.parametrize("kind", ["a1", "d1"])
def test_into_base_equals_peft_merge_and_unload(zoo, kind, tmp_path):
    out = merge_adapters([zoo[kind]], tmp_path / "out", "simple", base=zoo["base"], into_base=True)
    model = T.AutoModelForCausalLM.from_pretrained(str(out))
    got = {k: v.double() for k, v in model.state_dict().items()}
    want = effective_weights(zoo["base"], zoo[kind])
    assert max(_rel(got[k], want[k]) for k in want if want[k].norm() > 0) < 1e-6
    assert json.loads((out / "symfuse_report.json").read_text())["output"] == "model"


def test_rank_truncates_with_the_stated_error(zoo, tmp_path):
    out = merge_adapters([zoo["a1"], zoo["a2"]], tmp_path / "out", "simple", basis="full", rank=3)
    d1, d2 = _deltas(zoo["a1"]), _deltas(zoo["a2"])
    report = json.loads((out / "symfuse_report.json").read_text())
    for k, got in _deltas(out).items():
        s = torch.linalg.svdvals(0.5 * d1[k] + 0.5 * d2[k])
        error = float(s[3:].norm() / s.norm())
        assert error > 0.1 and report["truncation"]["modules"][k] == pytest.approx(error, rel=1e-6)
        assert _rel(got, 0.5 * d1[k] + 0.5 * d2[k]) == pytest.approx(error, rel=1e-4)
    assert {m.rank for m in read_adapter(out).modules.values()} == {3}


def test_union_of_modules_counts_a_missing_module_as_no_update(zoo, tmp_path):
    out = merge_adapters([zoo["a1"], zoo["q"]], tmp_path / "out", "simple")
    d1, d2, got = _deltas(zoo["a1"]), _deltas(zoo["q"]), _deltas(out)
    assert got.keys() == d1.keys() and d2.keys() < d1.keys()
    assert _max_rel(got, {k: 0.5 * d1[k] + 0.5 * d2.get(k, 0 * d1[k]) for k in d1}) < 1e-6
    assert {m.rank for m in read_adapter(out).modules.values()} == {6}  # 4 + 2: the largest sum of ranks


def test_refusals_name_the_problem_and_write_nothing(zoo, tmp_path):
    other = edited_copy(zoo["a2"], tmp_path / "other", base_model_name_or_path="/elsewhere/base")
    bias = edited_copy(zoo["a2"], tmp_path / "bias", lora_bias=True)
    cases = [
        (([zoo["a1"], other], "simple"), {}, CheckpointError, "merge adapters of one base"),
        (([zoo["a1"], bias], "simple"), {}, CheckpointError, "lora_bias is set"),
        (([zoo["d1"], zoo["d2"]], "simple"), {}, UsageError, "--base: missing — DoRA"),
        (([zoo["a1"], zoo["d1"]], "simple"), {"base": zoo["base"]}, CheckpointError, "DoRA adapters only"),
        (([zoo["a1"], zoo["rs"]], "simple"), {"basis": "naive"}, UsageError, "ranks differ"),
        (([zoo["a1"], zoo["a2"]], "regmean"), {}, UsageError, "adapters have none"),
        (([zoo["a1"]], "slerp"), {}, UsageError, "--adapters: 1 model(s) given"),
        (([zoo["base"]], "simple"), {}, CheckpointError, "not a PEFT adapter folder"),
    ]
    for (ads, strategy), kw, exc, text in cases:
        with pytest.raises(exc, match=re.escape(text)):
            merge_adapters(ads, tmp_path / "out", strategy, **kw)
        assert not (tmp_path / "out").exists()
