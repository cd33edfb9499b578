"""Activation-based matching: streaming statistics, function preservation, disguise recovery."""

import copy

import pytest
import torch

from symfuse.arch import get_spec
from symfuse.match.activation import (
    RANDOM_PIXELS,
    head_similarity,
    match_activation_checkpoints,
    match_activations,
    matched_model,
    residual_permutation,
)
from symfuse.stats.activations import PairedMoments, collect_activation_stats
from symfuse.symmetry.random import random_module_transform
from symfuse.symmetry.residual import permute_residual
from tests.tiny import DECODERS, random_inputs, tiny_model

CASES = [
    ("bert", "mlm"),
    ("roberta", "seq"),
    ("gpt2", "lm"),
    ("llama", "lm"),
    ("electra", "seq"),
    ("qwen3", "lm"),
    ("gemma2", "lm"),
    ("phi3", "lm"),
    ("vit", "seq"),
    ("albert", "seq"),
    ("t5", "lm"),
    ("t5-gated", "lm"),
    ("clip", "base"),
]


def _model(family, head, seed):
    return tiny_model(family, seed=seed, head=head, **({"pad_token_id": 0} if family in DECODERS else {}))


def _batches(model, n=3):
    return [random_inputs(model, batch=4, seq=16, seed=s) for s in range(n)]


def _logits(model, inputs):
    with torch.no_grad():
        return get_spec(model.config).main_output(model(**inputs))  # CLIP: logits_per_image


def _disguise(model, seed):
    """Random residual permutation + per-module head / FFN permutations + QK / VO rotations (same function)."""
    spec, cfg = get_spec(model.config), model.config
    geo = spec.geometry(cfg)
    g = torch.Generator().manual_seed(seed)
    perms = {s: torch.randperm(d, generator=g) for s, d in spec.streams(cfg).items()}  # CLIP: one per tower
    state = permute_residual(model.state_dict(), spec, cfg, perms)
    prefix = spec.detect_prefix(state)
    for ref in spec.modules(cfg):
        t = random_module_transform(ref, geo, g, kinds=("head-permutation", "ffn-permutation", "rotation"))
        w = spec.read_module(state.__getitem__, state.__contains__, ref, cfg, prefix)
        state.update(spec.write_module(t.apply(w), ref, cfg, prefix))
    out = copy.deepcopy(model)
    out.load_state_dict(state)
    return out.eval()


def _rel_distance(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    num = sum(float(((sa[k].double() - sb[k].double()) ** 2).sum()) for k in sa if sa[k].is_floating_point())
    den = sum(float((sa[k].double() ** 2).sum()) for k in sa if sa[k].is_floating_point())
    return (num / den) ** 0.5


def test_paired_moments_stream_equals_batch():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(100, 5, generator=g), torch.randn(100, 3, generator=g)
    b[:, 0] = 2 * a[:, 1] + 1
    m = PairedMoments()
    for i in range(0, 100, 30):
        m.update(a[i : i + 30], b[i : i + 30])
    ref = torch.corrcoef(torch.cat([a, b], 1).T.double())[:5, 5:]
    torch.testing.assert_close(m.correlation(), ref, rtol=0, atol=1e-10)
    assert abs(float(m.correlation()[1, 0]) - 1) < 1e-10


def test_statistics_skip_padding_and_see_every_site():
    model = _model("bert", "mlm", 0)
    other = _model("bert", "mlm", 1)
    stats = collect_activation_stats(model, other, _batches(model, 1))
    n_tokens = int(random_inputs(model, batch=4, seq=16, seed=0)["attention_mask"].sum())
    assert {m.n for m in stats.sites.values()} == {n_tokens}
    assert stats.residual_sites() == ["resid.emb", "resid.L00.attn", "resid.L00.ffn", "resid.L01.attn", "resid.L01.ffn"]
    assert stats.sites["ffn.L00"].cross.shape == (48, 48) and stats.sites["heads.L01"].cross.shape == (32, 32)


@pytest.mark.parametrize(("family", "head"), CASES)
def test_matching_two_different_models_preserves_function(family, head):
    source, anchor = _model(family, head, 1), _model(family, head, 2)
    result = match_activations(source, anchor, _batches(source))
    matched = matched_model(source, result)
    for seed in (5, 6):
        inputs = random_inputs(source, batch=3, seq=9, seed=seed)
        torch.testing.assert_close(_logits(matched, inputs), _logits(source, inputs), rtol=0, atol=1e-4)
    for perm in (r.perm for r in result.residuals.values()):
        assert not torch.equal(perm, torch.arange(len(perm)))
    assert sum(r["after"] for r in result.per_module) < sum(r["before"] for r in result.per_module)


@pytest.mark.parametrize(("family", "head"), CASES)
def test_disguise_is_recovered_from_activations(family, head):
    model = _model(family, head, 3)
    disguised = _disguise(model, seed=11)
    assert _rel_distance(disguised, model) > 0.1
    inputs = random_inputs(model, batch=2, seq=9, seed=9)
    torch.testing.assert_close(_logits(disguised, inputs), _logits(model, inputs), rtol=0, atol=1e-4)
    result = match_activations(disguised, model, _batches(model), residual_strategy="all")
    assert _rel_distance(matched_model(disguised, result), model) <= 1e-4


@pytest.mark.parametrize("strategy", ["first", "last", "all"])
def test_every_residual_strategy_recovers_a_planted_permutation(strategy):
    model = _model("gpt2", "lm", 4)
    perm = torch.randperm(32, generator=torch.Generator().manual_seed(2))
    spec = get_spec(model.config)
    moved = copy.deepcopy(model)
    moved.load_state_dict(permute_residual(model.state_dict(), spec, model.config, perm))
    stats = collect_activation_stats(model, moved.eval(), _batches(model, 2))
    assert torch.equal(residual_permutation(stats, strategy), torch.argsort(perm))  # undoes the planted one


def test_head_similarity_is_one_for_rotated_copies():
    model = _model("bert", "mlm", 5)
    disguised = _disguise(model, seed=1)
    stats = collect_activation_stats(model, disguised, _batches(model, 2))
    sim = head_similarity(stats, 0, 4, 4)  # [source group, anchor group]
    best = sim.max(dim=0).values
    torch.testing.assert_close(best, torch.ones(4, dtype=torch.float64), rtol=0, atol=1e-6)
    assert float(sim.max()) <= 1 + 1e-9


def test_vit_checkpoints_match_from_random_pixels_without_a_tokenizer(tmp_path):
    """A pixel family needs no tokenizer: --data random-pixels feeds seeded images; a text dataset is refused."""
    model = _model("vit", "seq", 3)
    model.save_pretrained(tmp_path / "anchor")
    _disguise(model, seed=5).save_pretrained(tmp_path / "source")
    with pytest.raises(ValueError, match=r"vit model reads pixels .* pass --data random-pixels"):
        match_activation_checkpoints(tmp_path / "source", tmp_path / "anchor", tmp_path / "bad", "sst2")
    assert not (tmp_path / "bad").exists()
    report = match_activation_checkpoints(
        tmp_path / "source", tmp_path / "anchor", tmp_path / "out", RANDOM_PIXELS, max_examples=48
    )
    assert report["max_abs_logit_diff"] <= 1e-4
    assert report["distance_after"] <= 1e-4 * report["distance_before"]
    assert (tmp_path / "out" / "model.safetensors").exists()


def test_clip_disguised_with_one_residual_permutation_per_tower_is_recovered_from_random_inputs(tmp_path):
    """CLIP: `disguise --kinds residual-permutation` draws one permutation per tower (saved as perm.text and
    perm.vision); activation matching from seeded random pixels AND tokens (the family reads both) undoes both."""
    from safetensors.torch import load_file

    from symfuse.match import disguise_checkpoint
    from symfuse.match.checkpoints import RESIDUAL_FILE

    model = _model("clip", "base", 3)
    model.save_pretrained(tmp_path / "anchor")
    kinds = ("residual-permutation", "head-permutation", "ffn-permutation", "rotation")
    disguise_checkpoint(tmp_path / "anchor", tmp_path / "source", seed=4, kinds=kinds)
    perms = load_file(tmp_path / "source" / RESIDUAL_FILE)
    assert {k: v.numel() for k, v in perms.items()} == {"perm.text": 32, "perm.vision": 24}
    report = match_activation_checkpoints(
        tmp_path / "source", tmp_path / "anchor", tmp_path / "out", RANDOM_PIXELS, max_examples=48
    )
    assert report["max_abs_logit_diff"] <= 1e-4
    assert report["distance_before"] > 1 and report["distance_after"] <= 1e-5 * report["distance_before"], report
    saved = load_file(tmp_path / "out" / "transforms.safetensors")
    assert {k.partition("/")[0] for k in saved} >= {"residual.text", "residual.vision", "vision.L01.ffn"}


def test_t5_residual_permutation_recovered_from_a_text_dataset(tmp_path):
    """Encoder-decoder from texts: the decoder reads the same tokens (decoder_input_ids), and the one residual
    permutation of encoder, decoder and cross-attention is recovered exactly."""
    import json

    from symfuse.match import disguise_checkpoint
    from tests.cli.helpers import toy_dataset

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "i", "feel", "so", "happy", "angry", "today"]
    vocab += [f"w{i}" for i in range(256 - len(vocab))]
    src = tmp_path / "src"
    tiny_model("t5", seed=1, head="lm", vocab_size=len(vocab)).save_pretrained(src)
    (src / "vocab.txt").write_text("\n".join(vocab) + "\n")  # a word-level tokenizer for the toy dataset
    (src / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizer"}))
    disguise_checkpoint(src, tmp_path / "d", seed=3, kinds=("residual-permutation",))
    data = toy_dataset(tmp_path / "toy")
    report = match_activation_checkpoints(
        tmp_path / "d", src, tmp_path / "out", str(data), symmetries=("residual-permutation",)
    )
    assert report["distance_before"] > 1 and report["distance_after"] <= 1e-6 * report["distance_before"], report
    assert report["max_abs_logit_diff"] <= 1e-4


def test_a_decoder_residual_permutation_recovered_from_a_language_modelling_dataset(tmp_path):
    """A causal LM's natural data has texts only: `match --data tinyshakespeare` was refused as 'no labels'."""
    import json

    from symfuse.match import disguise_checkpoint

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "to", "be", "or", "not", "that", "is", "question"]
    vocab += [f"w{i}" for i in range(256 - len(vocab))]
    src = tmp_path / "src"
    tiny_model("llama", seed=1, head="lm", vocab_size=len(vocab), pad_token_id=0).save_pretrained(src)
    (src / "vocab.txt").write_text("\n".join(vocab) + "\n")
    (src / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizer"}))
    disguise_checkpoint(src, tmp_path / "d", seed=3, kinds=("residual-permutation",))
    lm = tmp_path / "lm"
    lm.mkdir()
    (lm / "meta.json").write_text(json.dumps({"task": "language_modeling"}))
    words = vocab[5:]
    lines = [" ".join(words[(7 * i + 3 * j) % len(words)] for j in range(12)) for i in range(64)]
    (lm / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    report = match_activation_checkpoints(
        tmp_path / "d", src, tmp_path / "out", str(lm), symmetries=("residual-permutation",)
    )
    assert report["distance_before"] > 1 and report["distance_after"] <= 1e-6 * report["distance_before"], report
    assert report["max_abs_logit_diff"] <= 1e-4
    from symfuse.match.align import align_checkpoints  # the stream map started from the texts' hidden states

    ortho = align_checkpoints(tmp_path / "d", src, tmp_path / "ro", ["residual-orthogonal"], str(lm))
    assert ortho["exact"] and ortho["distance_after"] <= 1e-6 * ortho["distance_before"], ortho
