"""Spec coverage: every family resolves every tensor name on its tiny model, and round-trips."""

import pytest
import torch

from symfuse.arch import ModuleRef, get_spec, supported_model_types
from symfuse.arch.spec import ATTN_ROLES, FFN_ROLES
from symfuse.errors import UnsupportedArchitecture
from tests.tiny import FAMILIES, tiny_model


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("head", ["base", "seq"])
def test_every_module_tensor_resolves_and_round_trips(family, head):
    model = tiny_model(family, head=head)
    sd = model.state_dict()
    spec = get_spec(model.config)
    prefix = spec.detect_prefix(sd)
    assert prefix == ("" if head == "base" or family == "clip" else spec.base_prefix + ".")
    claimed = set()
    for ref in spec.modules(model.config):
        geo = spec.geometry(model.config).of(ref.stack)
        w = spec.read_module(sd.__getitem__, sd.__contains__, ref, model.config, prefix)
        roles = ATTN_ROLES if ref.kind == "attn" else FFN_ROLES
        assert set(w) <= {r for r in roles} | {r + "_bias" for r in roles}
        if ref.kind == "attn":
            assert w["q"].shape == (geo.n_heads * geo.head_dim, geo.d_model)
            assert w["k"].shape == (geo.n_kv_heads * geo.head_dim, geo.d_model)
            assert w["o"].shape == (geo.d_model, geo.n_heads * geo.head_dim)
        else:
            assert w["up"].shape == (geo.d_ffn, geo.d_model)
            assert w["down"].shape == (geo.d_model, geo.d_ffn)
        back = spec.write_module(w, ref, model.config, prefix)
        for name, t in back.items():
            torch.testing.assert_close(t, sd[name], rtol=0, atol=0)
        claimed |= set(back)
    # every weight of every layer (of every stack) belongs to exactly one module, a norm, or nothing else
    geo = spec.geometry(model.config)
    layers = [(st, i) for st in spec.all_stacks() for i in range(geo.of(st.name).n_layers)]
    norms = tuple(p for st, i in layers for p in spec.stream_norm_paths(i, prefix, st.name))
    for st, i in layers:
        layer = prefix + st.layer.format(i=i) + "."
        rest = [k for k in sd if k.startswith(layer) and k not in claimed and not k.startswith(norms)]
        assert rest == [], f"{family}: layer tensors no role claims: {rest}"


def test_geometry_reads_gqa_and_rope():
    model = tiny_model("llama")
    geo = get_spec(model.config).geometry(model.config)
    assert (geo.n_heads, geo.n_kv_heads, geo.group_size, geo.rope, geo.gated) == (4, 2, 2, True, True)


def test_deberta_pos_projections_only_without_shared_key():
    sep, shared = tiny_model("deberta-v2"), tiny_model("deberta-v2-shared")
    spec = get_spec(sep.config)
    assert spec.geometry(sep.config).pos_proj and not spec.geometry(shared.config).pos_proj
    assert "pos_q" in spec.tensor_names(ModuleRef(0, "attn"), sep.config)
    assert "pos_q" not in spec.tensor_names(ModuleRef(0, "attn"), shared.config)


def test_phi3_fused_rows_are_the_slices_the_model_uses():
    """gate_up_proj rows are [gate | up] and qkv_proj rows [q | k | v]: the canonical slices are what phi3 uses."""
    model = tiny_model("phi3")
    sd = model.state_dict()
    spec = get_spec(model.config)
    geo = spec.geometry(model.config)
    ffn = spec.read_module(sd.__getitem__, sd.__contains__, ModuleRef(0, "ffn"), model.config)
    fused = sd["layers.0.mlp.gate_up_proj.weight"]
    assert torch.equal(ffn["gate"], fused[: geo.d_ffn]) and torch.equal(ffn["up"], fused[geo.d_ffn :])
    x = torch.randn(3, geo.d_model)
    mlp = model.layers[0].mlp
    with torch.no_grad():
        want = mlp(x)
        got = (mlp.activation_fn(x @ ffn["gate"].T) * (x @ ffn["up"].T)) @ ffn["down"].T
    torch.testing.assert_close(got, want)
    attn = spec.read_module(sd.__getitem__, sd.__contains__, ModuleRef(1, "attn"), model.config)
    q_out = geo.n_heads * geo.head_dim
    assert torch.equal(attn["q"], sd["layers.1.self_attn.qkv_proj.weight"][:q_out])
    assert attn["k"].shape == attn["v"].shape == (geo.n_kv_heads * geo.head_dim, geo.d_model)


def test_qwen3_qk_norms_are_attention_roles_and_flag_the_geometry():
    model = tiny_model("qwen3")
    sd = model.state_dict()
    spec = get_spec(model.config)
    w = spec.read_module(sd.__getitem__, sd.__contains__, ModuleRef(0, "attn"), model.config)
    assert torch.equal(w["q_norm"], sd["layers.0.self_attn.q_norm.weight"]) and w["k_norm"].shape == (8,)
    assert spec.geometry(model.config).qk_norm and not get_spec("llama").geometry(tiny_model("llama").config).qk_norm


def test_albert_modules_are_the_stored_layers_and_unsupported_grouping_is_refused():
    model = tiny_model("albert", num_hidden_groups=1)  # 3 applications of one stored layer
    spec = get_spec(model.config)
    assert [r.key for r in spec.modules(model.config)] == ["L00.attn", "L00.ffn"]
    two = tiny_model("albert", num_hidden_layers=4, num_hidden_groups=2)
    assert len(spec.modules(two.config)) == 4
    assert (
        "encoder.albert_layer_groups.1.albert_layers.0.ffn.weight"
        in spec.tensor_names(ModuleRef(1, "ffn"), two.config).values()
    )
    cfg = tiny_model("albert").config
    cfg.inner_group_num = 2
    with pytest.raises(
        UnsupportedArchitecture, match=r"albert: inner_group_num=2 is not supported \(only inner_group_num=1\)"
    ):
        spec.geometry(cfg)


def test_partial_rotary_is_refused_with_the_fix():
    cfg = tiny_model("phi3").config
    cfg.rope_parameters = {**cfg.rope_parameters, "partial_rotary_factor": 0.5}
    with pytest.raises(UnsupportedArchitecture, match=r"phi3: partial_rotary_factor=0.5 .*1\.0"):
        get_spec(cfg).geometry(cfg)


def test_unsupported_family_lists_supported():
    with pytest.raises(
        UnsupportedArchitecture,
        match=r"supported: .*albert.*bert.*clip.*electra.*gemma.*gemma2.*llama.*phi3.*qwen3.*t5",
    ):
        get_spec("bart")
    assert "gpt2" in supported_model_types()


def test_module_ref_key_round_trip():
    ref = ModuleRef(7, "ffn")
    assert ref.key == "L07.ffn" and ModuleRef.parse(ref.key) == ref
    with pytest.raises(ValueError, match="not a module key"):
        ModuleRef.parse("7.ffn")


def test_stack_module_keys_round_trip_and_sort_by_stack():
    ref = ModuleRef(3, "attn", stack="cross")
    assert ref.key == "cross.L03.attn" and ModuleRef.parse(ref.key) == ref
    assert ModuleRef.parse("L03.attn") == ModuleRef(3, "attn") and ModuleRef.parse("L03.attn").stack == ""
    assert sorted([ModuleRef(0, "ffn", stack="enc"), ModuleRef(5, "attn", stack="dec")])[0].stack == "dec"
    for bad in ("x.y.L03.attn", "1enc.L03.attn", "enc.03.attn"):
        with pytest.raises(ValueError, match="not a module key"):
            ModuleRef.parse(bad)


def test_t5_stacks_geometry_and_head_table():
    """T5: three stacks on one stream; d_ff and d_kv (heads * d_kv != d_model) come from the config; layer 0's
    relative-bias table is an attention role of every stack that has one."""
    model = tiny_model("t5", head="lm")
    spec, cfg = get_spec(model.config), model.config
    geo = spec.geometry(cfg)
    assert [st.name for st in spec.all_stacks()] == ["enc", "dec", "cross"] and spec.streams(cfg) == {"": 32}
    assert (geo.of("enc").n_layers, geo.of("dec").n_layers, geo.of("cross").n_layers) == (2, 3, 3)
    assert (geo.d_ffn, geo.head_dim, geo.n_heads) == (48, 6, 4)
    assert geo.of("dec").shared_head_bias and not geo.of("cross").shared_head_bias
    sd = model.state_dict()
    w = spec.read_module(sd.__getitem__, sd.__contains__, ModuleRef(0, "attn", stack="dec"), cfg)
    assert torch.equal(w["head_table"], sd["decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"])
    assert "head_table" not in spec.read_module(sd.__getitem__, sd.__contains__, ModuleRef(1, "attn", stack="dec"), cfg)
    cross = spec.read_module(sd.__getitem__, sd.__contains__, ModuleRef(2, "attn", stack="cross"), cfg)
    assert torch.equal(cross["k"], sd["decoder.block.2.layer.1.EncDecAttention.k.weight"])
    assert spec.norm_paths(1, "", "cross") == {"attn": "decoder.block.1.layer.1.layer_norm"}
    assert set(spec.random_inputs(cfg)) == {"input_ids", "attention_mask", "decoder_input_ids"}


def test_clip_towers_have_their_own_shapes_and_streams():
    model = tiny_model("clip")
    spec, cfg = get_spec(model.config), model.config
    geo = spec.geometry(cfg)
    assert spec.streams(cfg) == {"text": 32, "vision": 24}
    assert (geo.of("vision").d_model, geo.of("vision").d_ffn, geo.of("text").d_ffn) == (24, 40, 48)
    inputs = spec.random_inputs(cfg, batch=3)
    assert inputs["pixel_values"].shape == (3, 3, 8, 8) and int(inputs["input_ids"].max()) < 64
    with torch.no_grad():
        out = model(**inputs)
    assert spec.main_output(out) is out.logits_per_image


def test_t5_gated_config_selects_the_gated_variant():
    """T5 v1.1 / mT5 (is_gated_act): wo(act(wi_0 x) * wi_1 x) — gate and up are wi_0 and wi_1, the plain variant
    reads wi; the variant is chosen from the config, a bare model type gets the plain family."""
    gated, plain = tiny_model("t5-gated"), tiny_model("t5")
    spec = get_spec(gated.config)
    assert spec.geometry(gated.config).gated and not get_spec(plain.config).geometry(plain.config).gated
    assert get_spec("t5") is get_spec(plain.config) is not spec
    sd = gated.state_dict()
    w = spec.read_module(sd.__getitem__, sd.__contains__, ModuleRef(1, "ffn", stack="dec"), gated.config)
    assert torch.equal(w["gate"], sd["decoder.block.1.layer.2.DenseReluDense.wi_0.weight"])
    assert torch.equal(w["up"], sd["decoder.block.1.layer.2.DenseReluDense.wi_1.weight"])
    ffn = gated.decoder.block[1].layer[2].DenseReluDense
    x = torch.randn(3, 32)
    with torch.no_grad():
        torch.testing.assert_close((ffn.act(x @ w["gate"].T) * (x @ w["up"].T)) @ w["down"].T, ffn(x))
