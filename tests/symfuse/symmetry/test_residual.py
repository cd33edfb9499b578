"""Residual-stream permutation: exact function preservation (tied embeddings included), inverse, Gram rule."""

import copy

import pytest
import torch

from symfuse.arch import ModuleRef, get_spec
from symfuse.errors import UnsupportedArchitecture
from symfuse.symmetry.residual import ResidualPermutation, permute_residual
from tests.tiny import DECODERS, random_inputs, tiny_model

CASES = [
    ("bert", "base"),
    ("bert", "seq"),
    ("bert", "token"),
    ("bert", "mlm"),
    ("roberta", "seq"),
    ("roberta", "mlm"),
    ("gpt2", "lm"),
    ("gpt2", "seq"),
    ("llama", "lm"),
    ("llama", "seq"),
    ("distilbert", "seq"),
    ("deberta-v2", "seq"),
    ("deberta-v2-shared", "mlm"),
    ("vit", "seq"),
    ("electra", "seq"),
    ("electra", "mlm"),
    ("qwen3", "lm"),
    ("gemma", "lm"),
    ("gemma2", "lm"),
    ("phi3", "seq"),
    ("albert", "seq"),
    ("albert", "mlm"),
]


def _outputs(model, inputs):
    with torch.no_grad():
        out = model(**inputs, output_hidden_states=True)
    main = out.logits if hasattr(out, "logits") and out.logits is not None else out.last_hidden_state
    return main, out.hidden_states


def _with_state(model, state):
    new = copy.deepcopy(model)
    new.load_state_dict(state)
    return new.eval()


@pytest.mark.parametrize(("family", "head"), CASES)
def test_residual_permutation_preserves_function(family, head):
    model = tiny_model(family, seed=1, head=head, **({"pad_token_id": 0} if family in DECODERS else {}))
    spec = get_spec(model.config)
    d = spec.geometry(model.config).d_model
    perm = torch.randperm(d, generator=torch.Generator().manual_seed(3))
    state = model.state_dict()
    new_state = permute_residual(state, spec, model.config, perm)
    changed = [n for n in state if not torch.equal(state[n], new_state[n])]
    assert changed, "permutation changed nothing"
    permuted = _with_state(model, new_state)
    inputs = random_inputs(model)
    ref, ref_hidden = _outputs(model, inputs)
    got, got_hidden = _outputs(permuted, inputs)
    if head == "base":  # the stream itself comes out permuted
        torch.testing.assert_close(got, ref[..., perm], rtol=0, atol=1e-5)
    else:
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    # every hidden state is exactly the permuted original (pre-norm families: the raw stream)
    for a, b in zip(ref_hidden, got_hidden, strict=True):
        torch.testing.assert_close(b, a[..., perm], rtol=0, atol=1e-5)
    # tied weights stay tied
    if getattr(model.config, "tie_word_embeddings", False) and head in ("mlm", "lm"):
        emb, dec = permuted.get_input_embeddings().weight, permuted.get_output_embeddings().weight
        assert emb.data_ptr() == dec.data_ptr() or torch.equal(emb, dec)
    # inverse round-trips exactly
    back = permute_residual(new_state, spec, model.config, ResidualPermutation(perm).inverse().perm)
    for n in state:
        assert torch.equal(back[n], state[n]), n


def test_module_gram_rule_and_merge():
    model = tiny_model("llama", seed=2)
    spec = get_spec(model.config)
    sd = model.state_dict()
    w = spec.read_module(sd.__getitem__, sd.__contains__, ModuleRef(0, "ffn"), model.config)
    p1, p2 = torch.randperm(32), torch.randperm(32)
    t1, t2 = ResidualPermutation(p1), ResidualPermutation(p2)
    x = torch.randn(50, 32, dtype=torch.float64)
    gram = x.T @ x
    # input of `up` after the transform is x[:, perm]; its Gram equals the transformed Gram
    xp = x[:, p1]
    torch.testing.assert_close(t1.apply_to_gram("up", gram), xp.T @ xp)
    assert torch.equal(t1.apply_to_gram("down", gram), gram)
    # up(x) is unchanged when x is permuted with the stream
    torch.testing.assert_close(t1.apply(w)["up"] @ xp.T.float(), w["up"] @ x.T.float(), rtol=0, atol=1e-5)
    fused = t2.merge(t1)
    step = t2.apply(t1.apply(w))
    for r, v in fused.apply(w).items():
        assert torch.equal(v, step[r])


def test_unknown_head_is_an_error():
    model = tiny_model("bert", seed=0)
    sd = dict(model.state_dict())
    sd["mystery_head.weight"] = torch.zeros(5, 32)
    spec = get_spec(model.config)
    with pytest.raises(UnsupportedArchitecture, match=r"mystery_head\.weight"):
        permute_residual(sd, spec, model.config, torch.arange(32))


@pytest.mark.parametrize(
    ("family", "overrides"),
    [("electra", {"embedding_size": 32}), ("albert", {"num_hidden_layers": 4, "num_hidden_groups": 2})],
)
def test_variants_without_projection_or_with_several_shared_groups(family, overrides):
    """ELECTRA without embeddings_project (embeddings in the stream) and ALBERT with two shared layer groups."""
    model = tiny_model(family, seed=2, head="seq", **overrides)
    spec = get_spec(model.config)
    perm = torch.randperm(32, generator=torch.Generator().manual_seed(4))
    new_state = permute_residual(model.state_dict(), spec, model.config, perm)
    emb = spec.detect_prefix(new_state) + "embeddings.word_embeddings.weight"
    changed = not torch.equal(new_state[emb], model.state_dict()[emb])
    assert changed == (family == "electra")  # ALBERT's embeddings live before embedding_hidden_mapping_in
    inputs = random_inputs(model)
    torch.testing.assert_close(
        _outputs(_with_state(model, new_state), inputs)[0], _outputs(model, inputs)[0], rtol=0, atol=1e-5
    )


@pytest.mark.parametrize(("family", "head"), [("t5", "lm"), ("t5-gated", "base"), ("clip", "base")])
def test_residual_permutation_of_multi_stack_families(family, head):
    """T5: ONE stream through encoder, decoder and cross-attention (the shared embedding ties them); CLIP: one
    permutation per tower, the joint projection space untouched. Every hidden state of every stack comes out
    permuted by its stream's permutation; logits (T5 LM, CLIP logits_per_image and joint embeddings) unchanged."""
    model = tiny_model(family, seed=1, head=head)
    spec = get_spec(model.config)
    g = torch.Generator().manual_seed(3)
    perms = {s: torch.randperm(d, generator=g) for s, d in spec.streams(model.config).items()}
    assert {s: len(p) for s, p in perms.items()} == ({"text": 32, "vision": 24} if family == "clip" else {"": 32})
    if family == "clip":
        with pytest.raises(ValueError, match=r"clip: give one residual permutation per stream \['text', 'vision'\]"):
            permute_residual(model.state_dict(), spec, model.config, perms["text"])
    new_state = permute_residual(model.state_dict(), spec, model.config, perms if family == "clip" else perms[""])
    permuted = _with_state(model, new_state)
    inputs = random_inputs(model)
    with torch.no_grad():
        ref, got = model(**inputs, output_hidden_states=True), permuted(**inputs, output_hidden_states=True)
    if family.startswith("t5"):
        pairs = [("encoder_hidden_states", ""), ("decoder_hidden_states", "")]
        seqs = [(getattr(ref, k), getattr(got, k), perms[s]) for k, s in pairs]
    else:
        seqs = [
            (getattr(ref, k).hidden_states, getattr(got, k).hidden_states, perms[s])
            for k, s in (("text_model_output", "text"), ("vision_model_output", "vision"))
        ]
    for a_seq, b_seq, p in seqs:
        assert len(a_seq) >= 3
        for a, b in zip(a_seq, b_seq, strict=True):
            torch.testing.assert_close(b, a[..., p], rtol=0, atol=1e-5)
    if head == "base" and family.startswith("t5"):
        torch.testing.assert_close(got.last_hidden_state, ref.last_hidden_state[..., perms[""]], rtol=0, atol=1e-5)
    else:
        keys = ("logits",) if family.startswith("t5") else ("logits_per_image", "text_embeds", "image_embeds")
        for k in keys:
            torch.testing.assert_close(getattr(got, k), getattr(ref, k), rtol=0, atol=1e-5)
    back = permute_residual(
        new_state, spec, model.config, {s: ResidualPermutation(p).inverse().perm for s, p in perms.items()}
    )
    for n, t in model.state_dict().items():
        assert torch.equal(back[n], t), n
