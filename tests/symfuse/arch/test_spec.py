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
    assert prefix == ("" if head == "base" else spec.base_prefix + ".")
    geo = spec.geometry(model.config)
    claimed = set()
    for ref in spec.modules(model.config):
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
    # every weight of every layer belongs to exactly one module, a norm, or nothing else
    for i in range(geo.n_layers):
        layer = prefix + spec.layer.format(i=i) + "."
        norms = tuple(spec.stream_norm_paths(i, prefix))
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
        UnsupportedArchitecture, match=r"supported: .*albert.*bert.*electra.*gemma.*gemma2.*llama.*phi3.*qwen3"
    ):
        get_spec("t5")
    assert "gpt2" in supported_model_types()


def test_module_ref_key_round_trip():
    ref = ModuleRef(7, "ffn")
    assert ref.key == "L07.ffn" and ModuleRef.parse(ref.key) == ref
    with pytest.raises(ValueError, match="not a module key"):
        ModuleRef.parse("7.ffn")
