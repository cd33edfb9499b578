"""OT fusion (symfuse.match.ot): EMD reduces to the exact permutation matchers; entropic OT is soft and marked so."""

import copy
import json

import pytest
import torch
from typer.testing import CliRunner

import symfuse.cli.match  # noqa: F401  (registers the commands)
from symfuse.arch import get_spec
from symfuse.cli import app
from symfuse.config import RunConfig
from symfuse.errors import SymfuseError
from symfuse.match.activation import match_activations
from symfuse.match.checkpoints import match_checkpoints
from symfuse.match.ot import as_permutation, ot_align, transport_plan
from symfuse.match.weights import match_module_weights
from symfuse.symmetry.residual import permute_residual
from symfuse.symmetry.transforms import FFNPermutation, HeadPermutation, load_transforms, save_transforms
from symfuse.symmetry.transport import FFNTransport, HeadTransport, ResidualTransport, transport_residual
from tests.symfuse.match.test_activation import _batches, _disguise, _logits, _model, _rel_distance
from tests.tiny import random_inputs, save_tiny, tiny_model

pytest.importorskip("ot")


def _perm_matrix(perm):
    m = torch.zeros(len(perm), len(perm), dtype=torch.float64)
    m[perm, torch.arange(len(perm))] = 1.0  # anchor unit j takes source unit perm[j]
    return m


def _modules(model):
    spec, cfg = get_spec(model.config), model.config
    st = model.state_dict()
    prefix = spec.detect_prefix(st)
    return {ref: spec.read_module(st.__getitem__, st.__contains__, ref, cfg, prefix) for ref in spec.modules(cfg)}


def _max_state_diff(a, b):
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a if a[k].is_floating_point())


# ------------------------------------------------------------------------------------------------ plans
def test_plans_have_uniform_marginals_and_emd_finds_a_planted_permutation():
    g = torch.Generator().manual_seed(0)
    for n, m, reg in ((5, 7, 0.0), (6, 6, 0.05), (4, 9, 0.1)):
        plan = transport_plan(torch.rand(n, m, generator=g), reg)
        torch.testing.assert_close(plan.sum(1), torch.full((n,), 1 / n, dtype=torch.float64), rtol=0, atol=1e-8)
        torch.testing.assert_close(plan.sum(0), torch.full((m,), 1 / m, dtype=torch.float64), rtol=0, atol=1e-8)
        assert as_permutation(plan) is None
    perm = torch.randperm(8, generator=g)
    cost = torch.rand(8, 8, generator=g) + 1.0
    cost[perm, torch.arange(8)] = 0.0  # the unique optimum: anchor j <- source perm[j]
    plan = transport_plan(cost)
    assert torch.equal(as_permutation(plan), perm)
    torch.testing.assert_close(plan * 8, _perm_matrix(perm), rtol=0, atol=1e-12)


def test_soft_maps_built_from_a_permutation_matrix_are_the_exact_permutations():
    model = _model("llama", "lm", 0)  # GQA: 4 query heads in 2 KV groups
    spec, cfg = get_spec(model.config), model.config
    geo = spec.geometry(cfg)
    g = torch.Generator().manual_seed(1)
    w = next(w for r, w in _modules(model).items() if r.kind == "attn")
    hp = torch.randperm(geo.n_kv_heads, generator=g)
    hp = hp if not torch.equal(hp, torch.arange(geo.n_kv_heads)) else hp.flip(0)
    soft, exact = HeadTransport(_perm_matrix(hp)).apply(w), HeadPermutation(hp).apply(w)
    assert all(torch.allclose(soft[k], exact[k], atol=1e-7) for k in exact)
    ffn = next(w for r, w in _modules(model).items() if r.kind == "ffn")
    fp = torch.randperm(geo.d_ffn, generator=g)
    soft, exact = FFNTransport(_perm_matrix(fp)).apply(ffn), FFNPermutation(fp).apply(ffn)
    assert all(torch.allclose(soft[k], exact[k], atol=1e-7) for k in exact)
    rp = torch.randperm(geo.d_model, generator=g)
    st = model.state_dict()
    soft, exact = transport_residual(st, spec, cfg, _perm_matrix(rp)), permute_residual(st, spec, cfg, rp)
    assert _max_state_diff(soft, exact) < 1e-7


# ------------------------------------------------------------------------------------------- reduces to perms
@pytest.mark.parametrize("family", ["bert", "llama"])
def test_weight_emd_per_module_is_exactly_the_weight_matchers_permutation(family):
    head = "lm" if family == "llama" else "mlm"
    source, anchor = _model(family, head, 1), _model(family, head, 2)
    geo = get_spec(source.config).geometry(source.config)
    ms, ma = _modules(source), _modules(anchor)
    for ref in ms:
        ot_t = match_module_weights(ref, ms[ref], ma[ref], geo, ("ot",))
        perm_t = match_module_weights(ref, ms[ref], ma[ref], geo, ("ffn-permutation", "head-permutation"))
        assert [type(p) for p in ot_t.parts] == [type(p) for p in perm_t.parts]  # exact parts, no soft map
        for p, q in zip(ot_t.parts, perm_t.parts, strict=True):
            assert torch.equal(p.perm, q.perm), ref.key


@pytest.mark.parametrize(("family", "head"), [("bert", "mlm"), ("llama", "lm"), ("vit", "seq")])
def test_weight_emd_undoes_a_disguise_through_the_residual_stream(family, head):
    model = _model(family, head, 3)
    disguised = _disguise(model, seed=11)  # residual + head + FFN permutations + QK / VO rotations
    assert _rel_distance(disguised, model) > 0.1
    result = ot_align(disguised, model, "weights", symmetries=("rotation",))
    assert result.exact and result.residual_exact and all(r["exact"] for r in result.per_module)
    aligned = copy.deepcopy(disguised)
    aligned.load_state_dict(result.state)
    assert _max_state_diff(result.state, model.state_dict()) <= 1e-6
    inputs = random_inputs(model, batch=2, seq=9, seed=9)
    torch.testing.assert_close(_logits(aligned, inputs), _logits(disguised, inputs), rtol=0, atol=1e-5)


def test_acts_emd_on_tiny_bert_equals_the_activation_permutations():
    source, anchor = _model("bert", "mlm", 1), _model("bert", "mlm", 2)
    batches = _batches(source)
    result = ot_align(source, anchor, "acts", batches=batches)
    perms = match_activations(source, anchor, batches, ("residual-permutation", "head-permutation", "ffn-permutation"))
    assert result.exact
    assert torch.equal(result.residual.perm, perms.residual.perm)
    assert not torch.equal(result.residual.perm, torch.arange(32))
    assert _max_state_diff(result.state, perms.state) == 0.0
    aligned = copy.deepcopy(source)
    aligned.load_state_dict(result.state)
    inputs = random_inputs(source, batch=3, seq=9, seed=5)
    torch.testing.assert_close(_logits(aligned, inputs), _logits(source, inputs), rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------------------ soft
@pytest.mark.parametrize("mode", ["weights", "acts"])
def test_entropic_ot_gives_valid_soft_maps_and_says_it_is_not_exact(mode):
    source, anchor = _model("bert", "mlm", 1), _model("bert", "mlm", 2)
    result = ot_align(source, anchor, mode, reg=0.05, batches=_batches(source))
    assert not result.exact and not result.residual_exact
    assert isinstance(result.residual, ResidualTransport)
    m = result.residual.map  # n * plan: rows and columns of the plan sum to 1/n
    ones = torch.ones(32, dtype=torch.float64)
    torch.testing.assert_close(m.sum(0), ones, rtol=0, atol=1e-6)
    torch.testing.assert_close(m.sum(1), ones, rtol=0, atol=1e-6)
    assert float(m.max()) < 1 - 1e-3  # genuinely soft
    soft = [p for t in result.modules.values() for p in t.parts if isinstance(p, (FFNTransport, HeadTransport))]
    assert soft and all(float(p.map.min()) >= 0 for p in soft)
    aligned = copy.deepcopy(source)
    aligned.load_state_dict(result.state)
    inputs = random_inputs(source, batch=2, seq=9, seed=5)
    out = _logits(aligned, inputs)
    assert torch.isfinite(out).all() and float((out - _logits(source, inputs)).abs().max()) > 1e-3
    with pytest.raises(ValueError, match="no exact inverse"):
        soft[0].inverse()


def test_pipeline_kind_ot_soft_round_trips_and_reports_inexact(tmp_path):
    src = save_tiny(tmp_path / "src", "bert", seed=1, head="seq")
    anc = save_tiny(tmp_path / "anc", "bert", seed=2, head="seq")
    assert RunConfig(datasets=[{"name": "a"}], symmetries=["ot-soft", "rotation"]).symmetries == ["ot-soft", "rotation"]
    report = match_checkpoints(src, anc, tmp_path / "soft", symmetries=["ot-soft"])
    assert report["exact"] is False and report["max_abs_logit_diff"] > 1e-4
    assert report["distance_after"] < report["distance_before"]
    ts = load_transforms(tmp_path / "soft" / "transforms.safetensors")  # soft parts are registered: they load
    assert {type(p) for t in ts.values() for p in t.parts} == {FFNTransport, HeadTransport}
    again = load_transforms(save_transforms(ts, tmp_path / "again.safetensors"))
    assert all(torch.equal(again[k].parts[0].map, ts[k].parts[0].map) for k in ts)
    exact = match_checkpoints(src, anc, tmp_path / "hard", symmetries=["ot"])
    perms = match_checkpoints(src, anc, tmp_path / "perm", symmetries=["ffn-permutation", "head-permutation"])
    assert exact["exact"] is True and exact["max_abs_logit_diff"] <= 1e-4
    assert exact["distance_after"] == pytest.approx(perms["distance_after"], rel=1e-9)


# ------------------------------------------------------------------------------------------- bad input
def test_different_family_or_shape_is_refused_in_one_line():
    bert = _model("bert", "base", 1)
    with pytest.raises(
        SymfuseError, match=r"^OT alignment needs two models of one family: source is bert, anchor is gpt2$"
    ):
        ot_align(bert, _model("gpt2", "base", 1))
    with pytest.raises(SymfuseError, match=r"needs equal shapes") as err:
        ot_align(bert, tiny_model("bert", seed=1, intermediate_size=64))
    assert "\n" not in str(err.value)


def _run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_cli_ot_matches_and_refuses_bad_input_in_one_line(tmp_path):
    src = save_tiny(tmp_path / "src", "bert", seed=1, head="seq")
    assert (
        _run(
            "disguise", src, "--out", tmp_path / "d", "--seed", 1, "--kinds", "ffn-permutation,head-permutation"
        ).exit_code
        == 0
    )
    r = _run("match", tmp_path / "d", src, "--out", tmp_path / "m", "--symmetries", "ot")
    assert r.exit_code == 0, r.output
    report = json.loads((tmp_path / "m" / "symfuse_report.json").read_text())
    assert report["exact"] is True and report["mode"] == "ot-weights"
    assert report["max_abs_logit_diff"] <= 1e-4 and report["distance_after"] <= 1e-5 * report["distance_before"]
    r = _run("match", tmp_path / "d", src, "--out", tmp_path / "s", "--symmetries", "ot-soft")
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "s" / "symfuse_report.json").read_text())["exact"] is False
    gpt = save_tiny(tmp_path / "gpt", "gpt2")
    for args, code, text in (
        (("--symmetries", "ot"), 1, "gpt2"),
        (("--symmetries", "ot-acts"), 2, "ot-acts aligns by activations — give --data"),
        (("--symmetries", "ot,ffn-permutation"), 2, "do not combine"),
    ):
        anchor = gpt if code == 1 else src
        r = _run("match", tmp_path / "d", anchor, "--out", tmp_path / "bad", *args)
        assert r.exit_code == code, r.output
        assert text in r.output and len(r.output.strip().splitlines()) == 1, r.output
        assert not (tmp_path / "bad").exists()


def test_a_sinkhorn_plan_that_stops_early_is_a_debug_line_not_pots_warning(monkeypatch, caplog):
    """POT's "Sinkhorn did not converge ... increase numItermax or reg" reached the console of match / merge."""
    import warnings

    import symfuse.match.ot as symfuse_ot

    monkeypatch.setattr(symfuse_ot, "SINKHORN_ITERS", 3)
    cost = torch.rand(6, 6, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(record=True) as seen, caplog.at_level("DEBUG", logger="symfuse.match.ot"):
        warnings.simplefilter("always")
        plan = symfuse_ot.transport_plan(cost, reg=0.01)
    assert not [w for w in seen if "Sinkhorn" in str(w.message)], [str(w.message) for w in seen]
    assert any("Sinkhorn stopped at 3 iterations" in r.getMessage() for r in caplog.records)
    assert plan.shape == (6, 6) and torch.isfinite(plan).all()


def test_a_tied_head_counts_once_in_the_distances_as_in_the_weights_driver(tmp_path):
    """OT counted a tied embedding twice (embedding and lm_head): 5.076 where the weights driver said 4.910."""
    from symfuse.match import align_checkpoints

    a, b = (save_tiny(tmp_path / n, "gpt2", seed=s, head="lm", pad_token_id=0) for n, s in (("a", 1), ("b", 2)))
    weights = align_checkpoints(b, a, tmp_path / "w", ["rotation", "scaling"], device="cpu")
    ot_report = align_checkpoints(b, a, tmp_path / "o", ["ot"], device="cpu")
    assert ot_report["distance_before"] == pytest.approx(weights["distance_before"], rel=1e-6)
