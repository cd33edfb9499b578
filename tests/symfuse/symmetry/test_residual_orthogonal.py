"""Residual-stream orthogonal maps: folding keeps the function, the family's group is exact and a larger one is not."""

import copy

import pytest
import torch

from symfuse.arch import get_spec
from symfuse.errors import UnsupportedArchitecture
from symfuse.symmetry.residual_orthogonal import (
    ResidualOrthogonal,
    fold_norms,
    procrustes_in_group,
    random_in_group,
    rotate_residual,
    unfold_into,
)
from tests.tiny import DECODERS, random_inputs, tiny_model

TOL = 1e-6  # float64 models; transformers computes RMSNorm in float32 whatever the model dtype
CASES = [("gpt2", "lm"), ("gpt2", "seq"), ("llama", "lm"), ("llama", "seq"), ("qwen3", "lm"), ("phi3", "seq"),
         ("vit", "seq")]  # fmt: skip


def _model(family, head, seed=1):
    model = tiny_model(family, seed=seed, head=head, **({"pad_token_id": 0} if family in DECODERS else {}))
    with torch.no_grad():  # non-trivial gains: folding must really move them
        for name, p in model.named_parameters():
            if ("norm" in name.lower() or "ln_" in name) and name.endswith("weight"):
                p.mul_(1 + 0.5 * torch.rand(p.shape, generator=torch.Generator().manual_seed(seed)))
    return model.double()


def _logits(model, state, untied, inputs):
    new = copy.deepcopy(model)
    if untied:
        new.config.tie_word_embeddings = False
        new = type(model)(new.config).double()
    new.load_state_dict(state)
    with torch.no_grad():
        out = new.eval()(**inputs)
    return out.logits


def _inputs(model):
    return {k: v.double() if v.is_floating_point() else v for k, v in random_inputs(model).items()}


@pytest.mark.parametrize(("family", "head"), CASES)
def test_fold_rotate_and_unfold_keep_the_function(family, head):
    model = _model(family, head)
    spec, cfg = get_spec(model.config), model.config
    inputs = _inputs(model)
    ref = _logits(model, model.state_dict(), False, inputs)
    folded, untied = fold_norms(model.state_dict(), spec, cfg)
    torch.testing.assert_close(_logits(model, folded, untied, inputs), ref, rtol=0, atol=TOL)
    d = spec.geometry(cfg).d_model
    rot = random_in_group(d, spec.residual_group, torch.Generator().manual_seed(5))
    rotated = rotate_residual(folded, spec, cfg, rot)
    torch.testing.assert_close(_logits(model, rotated, untied, inputs), ref, rtol=0, atol=TOL)
    other = _model(family, head, seed=7).state_dict()  # another model's norms: the function stays
    back, untied2 = unfold_into(rotated, other, spec, cfg)
    torch.testing.assert_close(_logits(model, back, untied or untied2, inputs), ref, rtol=0, atol=TOL)
    final = spec.detect_prefix(other) + spec.final_norm  # its bias stays the matched model's own
    stream = ("layernorm", "ln_", "_norm.", "input_layernorm", "post_attention_layernorm")  # not q_norm / k_norm
    norms = [n for n in other if any(s in n for s in stream) and "q_norm" not in n and "k_norm" not in n]
    norms = [n for n in norms if n in back and not n.startswith(final)]
    assert norms and all(torch.equal(back[n], other[n]) for n in norms)


def test_layernorm_families_need_the_ones_fixing_subgroup():
    model = _model("gpt2", "lm")
    spec, cfg = get_spec(model.config), model.config
    inputs = _inputs(model)
    ref = _logits(model, model.state_dict(), False, inputs)
    folded, untied = fold_norms(model.state_dict(), spec, cfg)
    general = random_in_group(spec.geometry(cfg).d_model, "orthogonal", torch.Generator().manual_seed(2))
    assert not torch.allclose(general.sum(1), torch.ones(general.shape[0], dtype=torch.float64))
    wrong = _logits(model, rotate_residual(folded, spec, cfg, general), untied, inputs)
    assert (wrong - ref).abs().max() > 1e-3  # centring does not commute: the model changed


def test_group_elements_and_procrustes():
    g = torch.Generator().manual_seed(0)
    d = 12
    for group in ("orthogonal", "orthogonal-fixing-ones"):
        o = random_in_group(d, group, g)
        torch.testing.assert_close(o @ o.T, torch.eye(d, dtype=torch.float64), rtol=0, atol=1e-12)
        if group.endswith("ones"):
            torch.testing.assert_close(o @ torch.ones(d, dtype=torch.float64), torch.ones(d, dtype=torch.float64))
        # Procrustes of a noisy cross matrix recovers the planted element
        x = torch.randn(50, d, generator=g, dtype=torch.float64)
        m = x.T @ (x @ o + 1e-3 * torch.randn(50, d, generator=g, dtype=torch.float64))
        torch.testing.assert_close(procrustes_in_group(m, group), o, rtol=0, atol=1e-3)


def test_post_ln_families_are_refused_in_one_line():
    model = tiny_model("bert", head="seq")
    with pytest.raises(UnsupportedArchitecture, match=r"bert: an orthogonal map .* use residual-permutation"):
        fold_norms(model.state_dict(), get_spec(model.config), model.config)


def test_unfolded_norms_must_be_folded_before_rotating():
    model = _model("llama", "lm")
    spec = get_spec(model.config)
    with pytest.raises(ValueError, match="fold the norms"):
        rotate_residual(model.state_dict(), spec, model.config, torch.eye(32, dtype=torch.float64))


def test_module_part_gram_rule():
    g = torch.Generator().manual_seed(1)
    o = random_in_group(6, "orthogonal", g)
    x = torch.randn(20, 6, generator=g, dtype=torch.float64)
    gram = x.T @ x
    part = ResidualOrthogonal(o)
    torch.testing.assert_close(part.apply_to_gram("q", gram), (x @ o).T @ (x @ o))
    assert part.apply_to_gram("o", gram) is gram
    torch.testing.assert_close(part.merge(part.inverse()).rot, torch.eye(6, dtype=torch.float64))
