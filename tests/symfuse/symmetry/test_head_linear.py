"""The head-linear kind's transforms: exact on every family, RoPE and GQA restrictions, Grams, round trips."""

import pytest
import torch

from symfuse.arch import ModuleRef
from symfuse.errors import VerificationError
from symfuse.match.verify import check_module_transform
from symfuse.symmetry import (
    HeadPermutation,
    ModuleTransform,
    QKLinear,
    VOLinear,
    check_kinds,
    load_transforms,
    random_module_transform,
    save_transforms,
)
from symfuse.symmetry.head_linear import random_linear, random_rope_linear
from tests.symfuse.symmetry.test_transforms import HEAD_LINEAR_KINDS as KINDS
from tests.symfuse.symmetry.test_transforms import _modules, _outputs, _transform_model
from tests.tiny import DECODERS, FAMILIES, random_inputs, tiny_model


def _draw(model, seed=0, kinds=KINDS):
    _, spec, geo, _ = _modules(model)
    g = torch.Generator().manual_seed(seed)
    return {ref.key: random_module_transform(ref, geo, g, kinds) for ref in spec.modules(model.config)}


def _identity(model):
    _, spec, _, _ = _modules(model)
    return {ref.key: ModuleTransform(ref.key, ()) for ref in spec.modules(model.config)}


def _attn0(model):
    sd, spec, geo, prefix = _modules(model)
    ref = next(r for r in spec.modules(model.config) if r.kind == "attn")
    return ref, geo.of(ref.stack), spec.read_module(sd.__getitem__, sd.__contains__, ref, model.config, prefix)


@pytest.mark.parametrize("family", FAMILIES)
def test_disguise_with_head_linear_keeps_the_function(family):
    model = tiny_model(family, head="lm" if family in DECODERS else "seq")
    inputs = random_inputs(model, seq=9)
    ts = _draw(model)
    parts = {type(p) for t in ts.values() for p in t.parts}
    geo = _modules(model)[2]
    assert VOLinear in parts and (QKLinear in parts) == (not geo.qk_norm)  # Qwen3: no QK map
    other = _transform_model(model, ts)
    moved = sum(
        float((a.float() - b.float()).norm())
        for a, b in zip(model.state_dict().values(), other.state_dict().values(), strict=True)
    )
    assert moved > 1.0
    diff = float((_outputs(model, inputs) - _outputs(other, inputs)).abs().max())
    assert diff <= 1e-4, f"{family}: max |Δ logit| = {diff}"


def test_drawn_maps_are_well_conditioned_and_rope_maps_are_scaled_pair_rotations():
    g = torch.Generator().manual_seed(0)
    m = random_linear(8, 50, g, 0.5)
    cond = torch.linalg.cond(m)
    assert float(cond.max()) <= 9 + 1e-9 and float(cond.mean()) > 1.5  # really not orthogonal
    r = random_rope_linear(8, 50, g, 0.5)
    h = 4
    i = torch.arange(h)
    torch.testing.assert_close(r[:, i, i], r[:, i + h, i + h])
    torch.testing.assert_close(r[:, i, i + h], -r[:, i + h, i])
    mask = torch.zeros(8, 8, dtype=torch.bool)
    mask[i, i] = mask[i + h, i + h] = mask[i, i + h] = mask[i + h, i] = True
    assert float(r[:, ~mask].abs().max()) == 0.0  # nothing outside the frequency pairs


def test_rope_forbids_a_map_that_does_not_commute_and_the_module_check_refuses_it():
    """llama: a general invertible QK map changes the logits and fails check_module_transform; a scaled rotation per
    frequency pair keeps both."""
    model = tiny_model("llama", head="lm")
    inputs = random_inputs(model, seq=9)
    ref, geo, w = _attn0(model)
    g = torch.Generator().manual_seed(3)
    errs = {}
    for name, mat in (
        ("general", random_linear(geo.head_dim, geo.n_kv_heads, g, 0.5)),
        ("rope", random_rope_linear(geo.head_dim, geo.n_kv_heads, g, 0.5)),
    ):
        mt = ModuleTransform(ref.key, (QKLinear(mat),))
        ts = {**_identity(model), ref.key: mt}
        errs[name] = float((_outputs(model, inputs) - _outputs(_transform_model(model, ts), inputs)).abs().max())
        if name == "general":
            with pytest.raises(VerificationError, match="across positions"):
                check_module_transform(ref, w, mt.apply(w), geo, mt)
        else:
            assert check_module_transform(ref, w, mt.apply(w), geo, mt) <= 1e-5
    assert errs["general"] > 1e-3 and errs["rope"] <= 1e-5, errs


def test_gqa_maps_are_shared_by_the_group():
    """llama (4 query heads, 2 KV heads): both query heads of a group get their group's map; a different map on one
    query head of the group is not a symmetry."""
    model = tiny_model("llama", head="lm")
    inputs = random_inputs(model, seq=9)
    ref, geo, w = _attn0(model)
    dh, nkv = geo.head_dim, geo.n_kv_heads
    g = torch.Generator().manual_seed(5)
    mat = random_rope_linear(dh, nkv, g, 0.5)
    new = QKLinear(mat).apply(w)
    q, q2 = w["q"].double().reshape(geo.n_heads, dh, -1), new["q"].double().reshape(geo.n_heads, dh, -1)
    for h in range(geo.n_heads):
        torch.testing.assert_close(q2[h], mat[h // geo.group_size] @ q[h], rtol=1e-6, atol=1e-7)
    k, k2 = w["k"].double().reshape(nkv, dh, -1), new["k"].double().reshape(nkv, dh, -1)
    torch.testing.assert_close(k2, torch.linalg.inv(mat).mT @ k, rtol=1e-6, atol=1e-7)
    # head 1 (group 0) mapped by group 1's map instead: the scores change
    bad = dict(new)
    bad["q"] = q2.clone()
    bad["q"][1] = mat[1] @ q[1]
    bad["q"] = bad["q"].reshape(w["q"].shape).float()
    with pytest.raises(VerificationError):
        check_module_transform(ref, w, bad, geo, ModuleTransform(ref.key, (QKLinear(mat),)))
    ts = {**_identity(model), ref.key: ModuleTransform(ref.key, (QKLinear(mat),))}
    assert float((_outputs(model, inputs) - _outputs(_transform_model(model, ts), inputs)).abs().max()) <= 1e-5


def test_a_map_on_one_side_only_is_refused_by_the_module_check():
    """bert: the QK map applied to the queries but not the keys (or V without O) is not a symmetry."""
    model = tiny_model("bert")
    ref, geo, w = _attn0(model)
    g = torch.Generator().manual_seed(1)
    for part, role in (
        (QKLinear(random_linear(geo.head_dim, geo.n_kv_heads, g, 0.5)), "q"),
        (VOLinear(random_linear(geo.head_dim, geo.n_kv_heads, g, 0.5)), "v"),
    ):
        mt = ModuleTransform(ref.key, (part,))
        assert check_module_transform(ref, w, mt.apply(w), geo, mt) <= 1e-5
        half = {**w, role: mt.apply(w)[role]}
        with pytest.raises(VerificationError):
            check_module_transform(ref, w, half, geo, mt)


def test_inverse_compose_and_transforms_file_round_trip(tmp_path):
    model = tiny_model("gpt2")
    ref, geo, w = _attn0(model)
    t1, t2 = _draw(model, seed=1)[ref.key], _draw(model, seed=2)[ref.key]
    back = t1.inverse().apply(t1.apply(w))
    for r in w:
        torch.testing.assert_close(back[r], w[r], rtol=0, atol=1e-5)
    both, seq = t2.compose(t1), t2.apply(t1.apply(w))
    for r in w:
        torch.testing.assert_close(both.apply(w)[r], seq[r], rtol=0, atol=1e-5)
    for p in t1.parts:
        if not isinstance(p, HeadPermutation):  # a map after its inverse fuses to one identity part
            fused = p.compose(p.inverse())
            assert len(fused.parts) == 1
            torch.testing.assert_close(
                fused.parts[0].mat, torch.eye(geo.head_dim, dtype=torch.float64).expand_as(p.mat)
            )
    ts = _draw(model, seed=3)
    loaded = load_transforms(save_transforms(ts, tmp_path / "t.safetensors"))
    assert set(loaded) == set(ts)
    for k, t in ts.items():
        assert [type(p) for p in loaded[k].parts] == [type(p) for p in t.parts]
        for name, x in t.tensors().items():
            assert torch.equal(loaded[k].tensors()[name], x)


def test_condition_scales_the_module_check_tolerance():
    model = tiny_model("bert")
    ref, geo, w = _attn0(model)
    ill = torch.diag_embed(torch.tensor([1e3] + [1.0] * (geo.head_dim - 1), dtype=torch.float64))
    part = VOLinear(ill.expand(geo.n_kv_heads, -1, -1).contiguous())
    assert part.condition() == pytest.approx(1e3)
    mt = ModuleTransform(ref.key, (part,))
    assert check_module_transform(ref, w, mt.apply(w), geo, mt) < 16 * 1.2e-7 * 1e3


def test_head_linear_refuses_rotation_and_scaling_in_one_line():
    for other in ("rotation", "scaling"):
        with pytest.raises(ValueError, match=f"symmetries (head-linear and {other}|{other} and head-linear) exclude"):
            check_kinds(["head-linear", other])
        with pytest.raises(ValueError, match="exclude each other"):
            random_module_transform(
                ModuleRef(0, "attn"), _modules(tiny_model("bert"))[2], torch.Generator(), ["head-linear", other]
            )
    assert check_kinds(KINDS) == KINDS
