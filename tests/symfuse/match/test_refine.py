"""Learned refinement of the stream map: every iterate is exact, and the midpoint's loss on the data goes down."""

import copy

import torch

from symfuse.arch import get_spec
from symfuse.match.refine import group_map, lm_or_task_loss, refine_stream_map
from symfuse.match.residual_orthogonal import align_residual_orthogonal
from symfuse.symmetry.residual_orthogonal import rotate_residual
from tests.tiny import tiny_model


def _state(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_group_map_is_in_the_group():
    k = torch.randn(7, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    r = group_map(k, "orthogonal-fixing-ones")
    torch.testing.assert_close(r @ r.T, torch.eye(8, dtype=torch.float64))
    torch.testing.assert_close(r.sum(1), torch.ones(8, dtype=torch.float64))


def test_refinement_is_exact_and_lowers_the_midpoint_loss():
    a, b = (tiny_model("gpt2", seed=s, head="lm").double() for s in (1, 2))
    spec, cfg = get_spec(a.config), a.config
    r = align_residual_orthogonal(_state(b), _state(a), spec, cfg, kinds=("ffn-permutation",), iters=5)
    template = copy.deepcopy(a)
    template.config.tie_word_embeddings = not r.untied
    template = type(a)(template.config).double()
    g = torch.Generator().manual_seed(3)
    batches = [{"input_ids": torch.randint(2, 64, (4, 12), generator=g)} for _ in range(4)]

    def mid(aligned):
        params = {n: 0.5 * (r.anchor[n] + aligned[n]) for n, _ in template.named_parameters()}
        with torch.no_grad():
            return sum(float(lm_or_task_loss(template, params, x)) for x in batches) / len(batches)

    rot, _ = refine_stream_map(r.aligned, r.anchor, template, spec, "orthogonal-fixing-ones", batches, steps=40,
                                    lr=1e-2)  # fmt: skip
    refined = rotate_residual(r.aligned, spec, cfg, rot)
    assert mid(refined) < mid(r.aligned)  # the merged model's loss fell
    x = batches[0]["input_ids"]  # and the refined source still computes B's function exactly
    new = copy.deepcopy(template)
    new.load_state_dict({**new.state_dict(), **refined})
    with torch.no_grad():
        torch.testing.assert_close(new.eval()(input_ids=x).logits, b.eval()(input_ids=x).logits, rtol=0, atol=1e-9)
