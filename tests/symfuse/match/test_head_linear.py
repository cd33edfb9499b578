"""Matching with head-linear: disguise recovery on every family, the closest invertible maps, the command paths."""

import json

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file
from typer.testing import CliRunner

import symfuse.cli.commands  # noqa: F401  (registers the commands)
from symfuse.cli import app
from symfuse.config import RunConfig
from symfuse.match import match_module_weights
from symfuse.match.activation import match_activations, matched_model
from symfuse.match.head_linear import circuit_grams, circuit_similarity
from symfuse.match.linear_fit import MAX_COND, CircuitGrams, closest_linear, condition, half_gradient, objective
from symfuse.match.verify import check_module_transform
from symfuse.match.weights import attention_blocks, module_distance
from symfuse.symmetry import HeadPermutation, QKLinear, VOLinear, random_module_transform
from symfuse.symmetry.head_linear import random_linear
from tests.symfuse.match.test_weights import _module_weights, _norm
from tests.symfuse.symmetry.test_transforms import _modules, _outputs, _transform_model
from tests.tiny import FAMILIES, random_inputs, save_tiny, tiny_model

KINDS = ("head-linear", "head-permutation", "ffn-permutation")


def _run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.mark.parametrize("family", FAMILIES)
def test_match_recovers_a_head_linear_disguise_exactly(family):
    model = tiny_model(family, seed=1)
    g = torch.Generator().manual_seed(7)
    for ref, geo, w in _module_weights(model):
        disguise = random_module_transform(ref, geo, g, KINDS)
        src = disguise.apply(w)
        assert module_distance(src, w) > 0.1 * _norm(w)
        t = match_module_weights(ref, src, w, geo, KINDS)
        rel = module_distance(t.apply(src), w) / _norm(w)
        assert rel <= 1e-6, f"{family} {ref.key}: relative distance {rel}"
        assert check_module_transform(ref, src, t.apply(src), geo, t) <= 1e-4  # the matched module is exact
        if ref.kind == "attn" and geo.n_kv_heads > 1 and not geo.shared_head_bias:
            hp = next(p for p in t.parts if isinstance(p, HeadPermutation))
            dp = next(p for p in disguise.parts if isinstance(p, HeadPermutation))
            assert torch.equal(dp.perm[hp.perm], torch.arange(geo.n_kv_heads))  # paired on their circuits
        if ref.kind == "attn":
            assert {type(p) for p in t.parts} >= ({VOLinear} if geo.qk_norm else {QKLinear, VOLinear})


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_never_worse_than_rotation_and_scaling(family):
    """Unrelated models, no permutation (the same heads paired): the larger group fits at least as well."""
    a, b = tiny_model(family, seed=3), tiny_model(family, seed=4)
    for (ref, geo, wa), (_, _, wb) in zip(_module_weights(a), _module_weights(b), strict=True):
        if ref.kind != "attn":
            continue
        rs = module_distance(match_module_weights(ref, wb, wa, geo, ("rotation", "scaling")).apply(wb), wa)
        t = match_module_weights(ref, wb, wa, geo, ("head-linear",))
        assert module_distance(t.apply(wb), wa) <= rs * (1 + 1e-9)
        assert max(p.condition() for p in t.parts) <= MAX_COND


def test_independent_gpt2_pair_head_linear_is_closer_than_rotation_and_scaling():
    """Two independently initialised gpt2 (d 64, 4 heads): total distance after matching (issue 32's measurement)."""
    cfg = dict(n_embd=64, n_head=4, n_inner=256)
    a, b = (list(_module_weights(tiny_model("gpt2", seed=s, **cfg))) for s in (0, 1))
    pairs = [(ref, geo, wa, wb) for (ref, geo, wa), (_, _, wb) in zip(a, b, strict=True)]

    def total(kinds):
        d = [module_distance(match_module_weights(r, wb, wa, geo, kinds).apply(wb), wa) for r, geo, wa, wb in pairs]
        return sum(x * x for x in d) ** 0.5

    perms = ("head-permutation", "ffn-permutation")
    linear, rotation = total(("head-linear", *perms)), total(("rotation", "scaling", *perms))
    before = sum(module_distance(wb, wa) ** 2 for _, _, wa, wb in pairs) ** 0.5
    assert linear <= rotation < before, (linear, rotation, before)


def test_circuit_similarity_is_the_inner_product_of_the_d_by_d_circuits():
    model_a, model_b = tiny_model("llama", seed=1), tiny_model("llama", seed=2)
    (_, geo, wa), (_, _, wb) = next(_module_weights(model_a)), next(_module_weights(model_b))
    sim = circuit_similarity(wb, wa, geo)
    sb, ab = attention_blocks(wb, geo), attention_blocks(wa, geo)
    g, dh = geo.group_size, geo.head_dim

    def circuits(blocks, i):  # per query head of group i: QK (cols_q x cols_k) and OV, as d x d products
        q = blocks["q"][i].reshape(dh, g, -1)
        o = blocks["o"][i].reshape(dh, g, -1)
        return [q[:, r].T @ blocks["k"][i] for r in range(g)] + [o[:, r].T @ blocks["v"][i] for r in range(g)]

    for i in range(geo.n_kv_heads):
        for j in range(geo.n_kv_heads):
            want = sum(float((x * y).sum()) for x, y in zip(circuits(sb, i), circuits(ab, j), strict=True))
            assert sim[i, j].item() == pytest.approx(want, rel=1e-10)


def _grams(seed=0, n=3, dh=6, cols=(20, 14)):
    g = torch.Generator().manual_seed(seed)
    a, b = (torch.randn(n, dh, c, generator=g, dtype=torch.float64) for c in cols)
    a_star, b_star = (x + 0.3 * torch.randn(x.shape, generator=g, dtype=torch.float64) for x in (a, b))
    return a, b, a_star, b_star


def _circuit_grams(a, b, a_star, b_star):
    return CircuitGrams(a @ a.mT, b @ b.mT, a_star @ a.mT, b_star @ b.mT, a_star @ a_star.mT, b_star @ b_star.mT)


def test_objective_and_gradient_match_a_direct_computation():
    a, b, a_star, b_star = _grams()
    grams = _circuit_grams(a, b, a_star, b_star)
    m = random_linear(6, 3, torch.Generator().manual_seed(1), 0.5).requires_grad_(True)
    direct = ((m @ a - a_star) ** 2).sum((-2, -1)) + ((torch.linalg.inv(m).mT @ b - b_star) ** 2).sum((-2, -1))
    torch.testing.assert_close(objective(m.detach(), grams), direct.detach(), rtol=1e-10, atol=1e-10)
    direct.sum().backward()
    torch.testing.assert_close(half_gradient(m.detach(), grams), m.grad / 2, rtol=1e-9, atol=1e-10)


def test_closest_linear_recovers_a_planted_map_from_a_bad_start_and_never_loses():
    a, b, a_star, b_star = _grams(seed=2)
    m0 = random_linear(6, 3, torch.Generator().manual_seed(3), 0.5)
    exact = _circuit_grams(torch.linalg.inv(m0) @ a_star, m0.mT @ b_star, a_star, b_star)  # A = M0^-1 A*, B = M0^T B*
    eye = torch.eye(6, dtype=torch.float64).expand(3, 6, 6)
    torch.testing.assert_close(closest_linear(eye, exact), m0, rtol=1e-9, atol=1e-9)
    noisy = _circuit_grams(a, b, a_star, b_star)  # not an exact image: a local minimum, below the start
    m = closest_linear(eye, noisy)
    assert bool((objective(m, noisy) <= objective(eye, noisy)).all())
    assert bool((condition(m) <= MAX_COND).all())
    assert float(half_gradient(m, noisy).norm() / noisy.scale().sum()) < 1e-8  # stationary
    assert torch.equal(m, closest_linear(eye, noisy))  # deterministic


def test_circuit_grams_are_the_block_products():
    model_a, model_b = tiny_model("gpt2", seed=1), tiny_model("gpt2", seed=2)
    (_, geo, wa), (_, _, wb) = next(_module_weights(model_a)), next(_module_weights(model_b))
    cg = circuit_grams(wb, wa, geo, "v", "o")
    sb, ab = attention_blocks(wb, geo), attention_blocks(wa, geo)
    torch.testing.assert_close(cg.gaa, sb["v"] @ sb["v"].mT)
    torch.testing.assert_close(cg.cb, ab["o"] @ sb["o"].mT)
    torch.testing.assert_close(cg.hbb, ab["o"] @ ab["o"].mT)


# ---------------------------------------------------------------------------------------------- commands
def test_disguise_and_match_commands_with_head_linear(tmp_path):
    src = save_tiny(tmp_path / "src", "llama", seed=1, head="lm")
    r = _run("disguise", src, "--out", tmp_path / "d", "--seed", 2, "--kinds", ",".join(KINDS))
    assert r.exit_code == 0, r.output
    r = _run("match", tmp_path / "d", src, "--out", tmp_path / "m", "--symmetries", ",".join(KINDS))
    assert r.exit_code == 0, r.output
    report = json.loads((tmp_path / "m" / "symfuse_report.json").read_text())
    assert report["distance_before"] > 1 and report["distance_after"] < 1e-4, report
    assert report["max_abs_logit_diff"] <= 1e-4
    got, want = load_file(tmp_path / "m" / "model.safetensors"), load_file(src / "model.safetensors")
    assert all(torch.allclose(got[k], want[k], atol=1e-5) for k in want)


def test_head_linear_with_rotation_is_one_usage_error(tmp_path):
    src = save_tiny(tmp_path / "src", "bert", seed=1)
    for option, command in (("--symmetries", "match"), ("--kinds", "disguise")):
        args = (command, src, src) if command == "match" else (command, src)
        r = _run(*args, "--out", tmp_path / "o", option, "head-linear,rotation")
        lines = [ln for ln in r.output.splitlines() if ln.strip()]
        assert r.exit_code == 2 and len(lines) == 1, r.output
        assert "head-linear and rotation exclude each other" in lines[0] and not (tmp_path / "o").exists()
    assert RunConfig.demo(symmetries=list(KINDS)).symmetries == list(KINDS)
    with pytest.raises(ValidationError, match="head-linear and scaling exclude each other"):
        RunConfig.demo(symmetries=["head-linear", "scaling"])


def test_match_many_with_head_linear_undoes_the_disguise(tmp_path):
    a = save_tiny(tmp_path / "a", "bert", seed=1, head="seq")
    assert _run("disguise", a, "--out", tmp_path / "b", "--seed", 3, "--kinds", ",".join(KINDS)).exit_code == 0
    c = save_tiny(tmp_path / "c", "bert", seed=2, head="seq")
    out = tmp_path / "aligned"
    r = _run("match-many", a, tmp_path / "b", c, "--anchor", "a", "--symmetries", ",".join(KINDS), "--out", out)
    assert r.exit_code == 0, r.output
    report = json.loads((out / "symfuse_many_report.json").read_text())
    assert all(m["max_abs_logit_diff"] <= 1e-4 for m in report["models"]), report
    by = {m["out"]: m for m in report["models"]}
    assert by["b"]["distance_after"] < 1e-4 and by["c"]["distance_after"] < by["c"]["distance_before"]


def test_activation_matching_fits_head_linear_on_the_weights_after_the_permutations():
    """``match --data``: heads and neurons from activations, then the invertible maps from the weights."""
    anchor = tiny_model("llama", seed=1, head="lm")
    _, spec, geo, _ = _modules(anchor)
    g = torch.Generator().manual_seed(0)
    ts = {ref.key: random_module_transform(ref, geo, g, KINDS) for ref in spec.modules(anchor.config)}
    source = _transform_model(anchor, ts)
    batches = [random_inputs(anchor, seed=s) for s in range(3)]
    res = match_activations(source, anchor, batches, symmetries=KINDS)
    assert all(m["before"] > 1 and m["after"] < 1e-6 for m in res.per_module), res.per_module
    out = _outputs(matched_model(source, res), batches[0]) - _outputs(source, batches[0])
    assert float(out.abs().max()) <= 1e-5
