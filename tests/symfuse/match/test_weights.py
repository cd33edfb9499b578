"""Module matching on tiny models of every family: disguise recovery, self-match identity, lazy reads."""

import logging

import pytest
import torch

from symfuse.arch import get_spec
from symfuse.checkpoint import CheckpointReader
from symfuse.match import SYMMETRIES, match_module, match_module_weights
from symfuse.match.many import align_module
from symfuse.match.weights import module_distance
from symfuse.symmetry import (
    FFNPermutation,
    HeadPermutation,
    QKRotation,
    QKScaling,
    VOScaling,
    random_module_transform,
)
from tests.tiny import FAMILIES, save_tiny, tiny_model


def _module_weights(model):
    sd = model.state_dict()
    spec = get_spec(model.config)
    prefix = spec.detect_prefix(sd)
    geo = spec.geometry(model.config)
    for ref in spec.modules(model.config):
        yield ref, geo.of(ref.stack), spec.read_module(sd.__getitem__, sd.__contains__, ref, model.config, prefix)


def _norm(w):
    return sum(float((t.double() ** 2).sum()) for t in w.values()) ** 0.5


@pytest.mark.parametrize("family", FAMILIES)
def test_disguise_recovery_every_kind(family):
    model = tiny_model(family, seed=1)
    g = torch.Generator().manual_seed(7)
    for ref, geo, w in _module_weights(model):
        disguise = random_module_transform(ref, geo, g)
        src = disguise.apply(w)
        assert module_distance(src, w) > 0.1 * _norm(w)
        t = match_module_weights(ref, src, w, geo, SYMMETRIES)
        rel = module_distance(t.apply(src), w) / _norm(w)
        assert rel <= 1e-5, f"{family} {ref.key}: relative distance {rel}"
        if ref.kind == "attn" and geo.n_kv_heads > 1 and not geo.shared_head_bias:  # T5 self-attention: none
            hp = next(p for p in t.parts if isinstance(p, HeadPermutation))
            dp = next(p for p in disguise.parts if isinstance(p, HeadPermutation))
            assert torch.equal(dp.perm[hp.perm], torch.arange(geo.n_kv_heads))  # exactly the inverse
        if ref.kind == "ffn":
            fp = t.parts[0].perm
            assert torch.equal(disguise.parts[0].perm[fp], torch.arange(geo.d_ffn))


@pytest.mark.parametrize("symmetries", [SYMMETRIES, ("head-linear", "head-permutation", "ffn-permutation")])
@pytest.mark.parametrize("family", FAMILIES)
def test_self_match_is_identity(family, symmetries):
    model = tiny_model(family, seed=2)
    for ref, geo, w in _module_weights(model):
        t = match_module_weights(ref, w, w, geo, symmetries)
        for p in t.parts:
            if isinstance(p, (HeadPermutation, FFNPermutation)):
                assert torch.equal(p.perm, torch.arange(p.perm.numel()))
            elif isinstance(p, QKScaling) or hasattr(p, "scale"):
                torch.testing.assert_close(p.scale, torch.ones_like(p.scale), atol=1e-9, rtol=0)
            else:  # rotations, invertible maps (head-linear)
                mat = p.mat if hasattr(p, "mat") else p.rot
                torch.testing.assert_close(
                    mat, torch.eye(geo.head_dim, dtype=torch.float64).expand_as(mat), atol=1e-9, rtol=0
                )
        assert module_distance(t.apply(w), w) <= 1e-6 * _norm(w)


def test_rotation_only_matching_never_increases_distance():
    a, b = tiny_model("bert", seed=3), tiny_model("bert", seed=4)
    for (ref, geo, wa), (_, _, wb) in zip(_module_weights(a), _module_weights(b), strict=True):
        for sym in (("rotation",), ("rotation", "scaling"), ("ffn-permutation",), SYMMETRIES):
            t = match_module_weights(ref, wa, wb, geo, sym)
            assert module_distance(t.apply(wa), wb) <= module_distance(wa, wb) + 1e-6


def test_llama_rope_matching_only_yields_rope_commuting_maps():
    model = tiny_model("llama", seed=5)
    other = tiny_model("llama", seed=6)
    for (ref, geo, wa), (_, _, wb) in zip(_module_weights(model), _module_weights(other), strict=True):
        if ref.kind != "attn":
            continue
        t = match_module_weights(ref, wa, wb, geo, SYMMETRIES)
        rot = next(p for p in t.parts if isinstance(p, QKRotation)).rot
        h = geo.head_dim // 2
        mask = torch.zeros(geo.head_dim, geo.head_dim, dtype=torch.bool)
        i = torch.arange(h)
        mask[i, i] = mask[i + h, i + h] = mask[i, i + h] = mask[i + h, i] = True
        assert float(rot[:, ~mask].abs().max()) == 0.0
        torch.testing.assert_close(rot[:, i, i], rot[:, i + h, i + h])  # rotation, not reflection
        torch.testing.assert_close(rot[:, i, i + h], -rot[:, i + h, i])
        s = next(p for p in t.parts if isinstance(p, QKScaling)).scale
        torch.testing.assert_close(s[:, :h], s[:, h:])


def test_match_module_reads_only_that_module(tmp_path, monkeypatch):
    a = save_tiny(tmp_path / "a", "bert", seed=1, head="seq")
    b = save_tiny(tmp_path / "b", "bert", seed=2, head="seq")
    seen = []
    original = CheckpointReader.get

    def spy(self, name):
        seen.append(name)
        return original(self, name)

    monkeypatch.setattr(CheckpointReader, "get", spy)
    t = match_module(a, b, "L01.ffn", SYMMETRIES)
    assert t.key == "L01.ffn" and isinstance(t.parts[0], FFNPermutation)
    assert seen and all(".layer.1.intermediate." in n or ".layer.1.output.dense" in n for n in seen), seen


@pytest.mark.parametrize("family", FAMILIES)
def test_equivalent_sources_match_to_the_same_weights(family):
    # S and T.S (T: random exact rotations + scales, and permutations) are one function: matching either onto the
    # anchor must give the same weights. The former one-pass rotation-then-scale fit was 0.3 apart here.
    src, anc = tiny_model(family, seed=3), tiny_model(family, seed=4)
    g = torch.Generator().manual_seed(5)
    for (ref, geo, ws), (_, _, wa) in zip(_module_weights(src), _module_weights(anc), strict=True):
        for sym in (SYMMETRIES, ("rotation", "scaling")):
            if ref.kind == "ffn" and sym != SYMMETRIES:
                continue
            wt = random_module_transform(ref, geo, g, sym).apply(ws)
            m1 = match_module_weights(ref, ws, wa, geo, sym).apply(ws)
            m2 = match_module_weights(ref, wt, wa, geo, sym).apply(wt)
            rel = module_distance(m1, m2) / _norm(m1)
            assert rel <= 1e-6, f"{family} {ref.key} {sym}: S and T.S matched {rel:.2e} apart"


def test_barycenter_with_rotation_and_scaling_converges(caplog):
    # noisy disguised copies of one module (like fine-tunes of one model): generalised Procrustes over rotations
    # AND scales reaches its tolerance (it ran to max_iter before: orbit-dependent fits, drifting scale gauge)
    model = tiny_model("bert", seed=3)
    g = torch.Generator().manual_seed(1)
    ref, geo, w = next(m for m in _module_weights(model) if m[0].kind == "attn")
    ws = []
    for _ in range(3):
        noisy = {r: t + 0.3 * t.std() * torch.randn(t.shape, generator=g) for r, t in w.items()}
        ws.append(random_module_transform(ref, geo, g, kinds=("rotation", "scaling")).apply(noisy))
    with caplog.at_level(logging.DEBUG, logger="symfuse.match.many"):
        ts, n_iter = align_module(ref, ws, geo, ("rotation", "scaling"), "barycenter", max_iter=30, tol=1e-7)
    assert n_iter < 30
    assert f"{ref.key}: barycenter converged in {n_iter} iterations" in caplog.messages
    # gauge: per head, the models' scales have geometric mean 1
    for kind in (QKScaling, VOScaling):
        scales = torch.stack([next(p for p in t.parts if isinstance(p, kind)).scale for t in ts])
        torch.testing.assert_close(scales.log().mean(0), torch.zeros_like(scales[0]), atol=1e-12, rtol=0)
    # aligned copies are closer to each other than the disguised ones
    aligned = [t.apply(x) for t, x in zip(ts, ws, strict=True)]
    assert module_distance(aligned[0], aligned[1]) < 0.5 * module_distance(ws[0], ws[1])


def test_qwen3_matching_recovers_the_exact_disguise_and_skips_qk_maps(caplog):
    """Per-head q/k norms: asking for rotation / scaling fits V/O maps only (logged); the disguise is undone."""
    model = tiny_model("qwen3", seed=8)
    g = torch.Generator().manual_seed(9)
    for ref, geo, w in _module_weights(model):
        disguise = random_module_transform(ref, geo, g)
        src = disguise.apply(w)
        assert module_distance(src, w) > 0.1 * _norm(w)
        with caplog.at_level("DEBUG", logger="symfuse.match.weights"):
            t = match_module_weights(ref, src, w, geo, SYMMETRIES)
        assert module_distance(t.apply(src), w) <= 1e-6 * _norm(w)
        if ref.kind == "attn":
            assert not any(isinstance(p, (QKRotation, QKScaling)) for p in t.parts)
            assert {type(p).__name__ for p in t.parts} == {"HeadPermutation", "VORotation", "VOScaling"}
    assert "QK rotation / scaling skipped (not exact)" in caplog.text
