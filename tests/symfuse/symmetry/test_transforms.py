"""Transforms are exact: function preservation on every family, inverse / compose / save-load, Gram transport."""

import pytest
import torch

from symfuse.arch import ModuleRef, get_spec
from symfuse.symmetry import (
    FFNPermutation,
    HeadPermutation,
    ModuleTransform,
    QKRotation,
    QKScaling,
    VORotation,
    VOScaling,
    load_transforms,
    random_module_transform,
    random_orthogonal,
    rope_rotation,
    save_transforms,
)
from tests.tiny import DECODERS, FAMILIES, random_inputs, tiny_model


def _modules(model):
    sd = model.state_dict()
    spec = get_spec(model.config)
    prefix = spec.detect_prefix(sd)
    return sd, spec, spec.geometry(model.config), prefix


def _transform_model(model, transforms):
    """A NEW model (same class) whose module weights are transformed."""
    sd, spec, _, prefix = _modules(model)
    new = dict(sd)
    for ref in spec.modules(model.config):
        w = spec.read_module(sd.__getitem__, sd.__contains__, ref, model.config, prefix)
        new.update(spec.write_module(transforms[ref.key].apply(w), ref, model.config, prefix))
    other = type(model)(model.config).to(next(model.parameters()).dtype).eval()  # a float64 model stays float64
    other.load_state_dict(new)
    return other


def _outputs(model, inputs):
    with torch.no_grad():
        out = model(**inputs)
    return get_spec(model.config).main_output(out)  # logits (CLIP: logits_per_image), else last hidden state


KINDS = ("rotation", "scaling", "ffn-permutation", "head-permutation")
HEAD_LINEAR_KINDS = ("head-linear", "head-permutation", "ffn-permutation")


def _random_transforms(model, seed=0, kinds=KINDS):
    _, spec, geo, _ = _modules(model)
    g = torch.Generator().manual_seed(seed)
    return {ref.key: random_module_transform(ref, geo, g, kinds) for ref in spec.modules(model.config)}


@pytest.mark.parametrize("family", FAMILIES)
def test_random_transforms_of_every_kind_preserve_function(family):
    head = "lm" if family in DECODERS else "seq"
    model = tiny_model(family, head=head)
    inputs = random_inputs(model)
    ts = _random_transforms(model)
    other = _transform_model(model, ts)
    sd_a, sd_b = model.state_dict(), other.state_dict()
    moved = sum(float((sd_a[k].float() - sd_b[k].float()).norm()) for k in sd_a)
    assert moved > 1.0  # the weights really changed
    diff = (_outputs(model, inputs) - _outputs(other, inputs)).abs().max()
    assert diff <= 1e-4, f"{family}: max |Δ| = {diff}"


def test_rope_restriction_is_needed_and_sufficient():
    """A generic orthogonal QK map breaks llama (position-dependent RoPE); the RoPE-commuting one does not."""
    model = tiny_model("llama")
    inputs = random_inputs(model, seq=9)
    _, spec, geo, _ = _modules(model)
    g = torch.Generator().manual_seed(3)
    generic = {ref.key: ModuleTransform(ref.key, ()) for ref in spec.modules(model.config)}
    generic["L00.attn"] = ModuleTransform("L00.attn", (QKRotation(random_orthogonal(geo.head_dim, geo.n_kv_heads, g)),))
    bad = (_outputs(model, inputs) - _outputs(_transform_model(model, generic), inputs)).abs().max()
    assert bad > 1e-3  # tiny llama has 0.02-scale weights: 1e-3 is far above fp32 round-off
    good = (_outputs(model, inputs) - _outputs(_transform_model(model, _random_transforms(model)), inputs)).abs().max()
    assert good <= 1e-5


@pytest.mark.parametrize("family", ["llama", "deberta-v2", "gpt2"])
def test_inverse_compose_simplify_and_save_load(family, tmp_path):
    model = tiny_model(family)
    sd, spec, _geo, prefix = _modules(model)
    t1, t2 = _random_transforms(model, seed=1), _random_transforms(model, seed=2)
    for ref in spec.modules(model.config):
        w = spec.read_module(sd.__getitem__, sd.__contains__, ref, model.config, prefix)
        a, b = t1[ref.key], t2[ref.key]
        back = a.inverse().apply(a.apply(w))
        for r in w:
            torch.testing.assert_close(back[r], w[r], rtol=0, atol=1e-5)
        both = b.compose(a)
        seq = b.apply(a.apply(w))
        got = both.apply(w)
        for r in w:
            torch.testing.assert_close(got[r], seq[r], rtol=0, atol=1e-5)
        # a part composed with its own inverse fuses to the identity
        for p in a.parts:
            fused = p.compose(p.inverse())
            assert len(fused.parts) == 1
            ident = fused.apply(w)
            for r in w:
                torch.testing.assert_close(ident[r], w[r], rtol=0, atol=1e-5)
    file = save_transforms(t1, tmp_path / "t.safetensors")
    loaded = load_transforms(file)
    assert set(loaded) == set(t1)
    for k, t in t1.items():
        assert [type(p) for p in loaded[k].parts] == [type(p) for p in t.parts]
        for name, x in t.tensors().items():
            assert torch.equal(loaded[k].tensors()[name], x)


def _input_grams(model, inputs):
    """Grams sum_t x_t x_t^T of the inputs of every o / down projection (forward pre-hooks)."""
    _sd, spec, _, prefix = _modules(model)
    grams, hooks = {}, []
    for ref in spec.modules(model.config):
        paths = spec.module_paths(ref, model.config, prefix)
        role = "o" if ref.kind == "attn" else "down"

        def hook(_mod, args, key=ref.key):
            x = args[0].reshape(-1, args[0].shape[-1]).double()
            grams[key] = grams.get(key, 0) + x.T @ x

        hooks.append(model.get_submodule(paths[role]).register_forward_pre_hook(hook))
    with torch.no_grad():
        model(**inputs)
    for h in hooks:
        h.remove()
    return grams


@pytest.mark.parametrize("kinds", [KINDS, HEAD_LINEAR_KINDS])
@pytest.mark.parametrize("family", FAMILIES)
def test_transformed_gram_equals_gram_recollected_on_transformed_model(family, kinds):
    model = tiny_model(family).double()  # float64 throughout: the transport is exact up to float64 rounding
    inputs = {k: v.double() if v.is_floating_point() else v for k, v in random_inputs(model).items()}
    ts = _random_transforms(model, seed=5, kinds=kinds)
    before = _input_grams(model, inputs)
    after = _input_grams(_transform_model(model, ts), inputs)
    for key, g in before.items():
        role = "o" if key.endswith("attn") else "down"
        moved = ts[key].apply_to_gram(role, g)
        assert (after[key] - g).abs().max() > 1e-3 * g.abs().max()  # the transform really changes this Gram
        assert float((moved - after[key]).norm() / after[key].norm()) <= 1e-8, key
        # inputs of q/k/v/up (the residual stream) are untouched by per-module transforms
        assert ts[key].apply_to_gram("q" if role == "o" else "up", g) is g


def test_gram_parts_by_hand():
    """Closed forms: head permutation gathers head blocks, VO rotation is R G R^T blockwise, FFN P G P^T."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 8, generator=g, dtype=torch.float64)
    gram = x.T @ x  # 2 groups of 2 query heads of dh=2 -> n = 8
    perm = torch.tensor([1, 0])
    moved = HeadPermutation(perm).apply_to_gram("o", gram)
    xp = torch.cat([x[:, 4:], x[:, :4]], dim=1)
    torch.testing.assert_close(moved, xp.T @ xp)
    rot = random_orthogonal(2, 2, g)
    xr = torch.cat([x[:, 2 * h : 2 * h + 2] @ rot[h // 2].T for h in range(4)], dim=1)
    torch.testing.assert_close(VORotation(rot).apply_to_gram("o", gram), xr.T @ xr)
    s = torch.tensor([[2.0, 2.0], [0.5, 0.5]], dtype=torch.float64)
    xs = x * s.repeat_interleave(2, 0).reshape(-1)
    torch.testing.assert_close(VOScaling(s).apply_to_gram("o", gram), xs.T @ xs)
    fp = torch.randperm(8, generator=g)
    torch.testing.assert_close(FFNPermutation(fp).apply_to_gram("down", gram), x[:, fp].T @ x[:, fp])
    assert QKScaling(s).apply_to_gram("o", gram) is gram


def test_module_transform_key_and_kind():
    t = ModuleTransform(ModuleRef(3, "ffn").key, (FFNPermutation(torch.arange(4)),))
    assert (t.key, t.kind) == ("L03.ffn", "ffn")


def test_qwen3_qk_norm_allows_only_pair_sign_flips_and_no_qk_map_is_drawn():
    """Per-head q/k RMSNorm with learned weights: a RoPE-commuting QK rotation or a QK scaling changes the
    function; the exact QK maps (orthogonal, commuting with diag(w) and RoPE) are sign flips per frequency pair."""
    model = tiny_model("qwen3", head="lm")
    inputs = random_inputs(model, seq=9)
    _, spec, geo, _ = _modules(model)
    g = torch.Generator().manual_seed(4)
    base = {ref.key: ModuleTransform(ref.key, ()) for ref in spec.modules(model.config)}
    n, h = geo.n_kv_heads, geo.head_dim // 2
    rot = rope_rotation((torch.rand(n, h, generator=g, dtype=torch.float64) * 2 - 1) * 3.0)
    flips = torch.where(torch.rand(n, h, generator=g) < 0.5, -1.0, 1.0).to(torch.float64).repeat(1, 2)
    scale = torch.exp(torch.rand(n, h, generator=g, dtype=torch.float64) - 0.5).repeat(1, 2)
    errs = {}
    for name, part in (
        ("rope_rotation", QKRotation(rot)),
        ("qk_scale", QKScaling(scale)),
        ("pair_flips", QKRotation(torch.diag_embed(flips))),
    ):
        ts = {**base, "L00.attn": ModuleTransform("L00.attn", (part,))}
        errs[name] = float((_outputs(model, inputs) - _outputs(_transform_model(model, ts), inputs)).abs().max())
    assert errs["rope_rotation"] > 1e-3 and errs["qk_scale"] > 1e-3, errs
    assert errs["pair_flips"] <= 1e-5, errs
    # the disguise never draws a QK map for this family, but keeps the exact V/O ones
    ref = ModuleRef(0, "attn")
    kinds = {type(p) for p in random_module_transform(ref, geo, g).parts}
    assert kinds == {HeadPermutation, VORotation, VOScaling}
    assert {QKRotation, QKScaling} <= {
        type(p) for p in random_module_transform(ref, _modules(tiny_model("llama"))[2], g).parts
    }


def test_albert_two_shared_groups_one_transform_per_stored_layer_preserves_function():
    model = tiny_model("albert", head="seq", num_hidden_layers=4, num_hidden_groups=2)
    inputs = random_inputs(model)
    ts = _random_transforms(model, seed=3)
    assert sorted(ts) == ["L00.attn", "L00.ffn", "L01.attn", "L01.ffn"]  # 2 stored layers, 4 applications
    diff = (_outputs(model, inputs) - _outputs(_transform_model(model, ts), inputs)).abs().max()
    assert diff <= 1e-5


def test_t5_shared_bias_table_forbids_self_attention_head_permutations_only():
    """T5 adds layer 0's per-head bias table to the scores of EVERY layer of a stack: permuting the heads of one
    self-attention layer (its table columns with them) changes the function; cross-attention has no bias and a
    head permutation there is exact. The disguise never draws the inexact ones."""
    model = tiny_model("t5", head="lm")
    inputs = random_inputs(model, seq=9)
    _, spec, geo, _ = _modules(model)
    perm = HeadPermutation(torch.tensor([2, 0, 3, 1]))
    base = {ref.key: ModuleTransform(ref.key, ()) for ref in spec.modules(model.config)}
    errs = {}
    for key in ("enc.L00.attn", "enc.L01.attn", "dec.L01.attn", "cross.L01.attn"):
        ts = {**base, key: ModuleTransform(key, (perm,))}
        errs[key] = float((_outputs(model, inputs) - _outputs(_transform_model(model, ts), inputs)).abs().max())
    assert min(errs[k] for k in ("enc.L00.attn", "enc.L01.attn", "dec.L01.attn")) > 1e-3, errs
    assert errs["cross.L01.attn"] <= 1e-5, errs
    g = torch.Generator().manual_seed(0)
    drawn = {
        ref.key: {type(p) for p in random_module_transform(ref, geo, g).parts} for ref in spec.modules(model.config)
    }
    assert HeadPermutation not in drawn["enc.L00.attn"] | drawn["dec.L02.attn"]
    assert {HeadPermutation, QKRotation, VORotation, QKScaling, VOScaling} == drawn["cross.L00.attn"]
    assert {QKRotation, VORotation, QKScaling, VOScaling} == drawn["enc.L01.attn"]
    assert geo.of("cross").n_layers == geo.of("dec").n_layers == 3 and geo.of("enc").n_layers == 2
