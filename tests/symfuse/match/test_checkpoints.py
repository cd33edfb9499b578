"""Checkpoint-level matching: matched folders keep SOURCE's function, disguises are undone, multi-model anchors."""

import json

import pytest
import torch
import transformers as T
from safetensors.torch import load_file

from symfuse.checkpoint import CheckpointReader, resolve_checkpoint
from symfuse.match import (
    REPORT_FILE,
    SYMMETRIES,
    TRANSFORMS_FILE,
    assemble_matched,
    disguise_checkpoint,
    load_transform,
    match_checkpoints,
    match_many,
    match_module,
    match_module_many,
    save_transform,
)
from symfuse.symmetry import load_transforms
from tests.tiny import DECODERS, FAMILIES, random_inputs, save_tiny


def _head(family):
    return "lm" if family in DECODERS else "seq"


def _module_keys(family):
    def stack(name, n, kinds=("attn", "ffn")):
        return {f"{name}L{i:02d}.{k}" for i in range(n) for k in kinds}

    if family == "albert":  # one stored layer shared by all applications
        return stack("", 1)
    if family.startswith("t5"):  # 2 encoder layers; 3 decoder layers, each with a cross-attention
        return stack("enc.", 2) | stack("dec.", 3) | stack("cross.", 3, ("attn",))
    if family == "clip":
        return stack("text.", 2) | stack("vision.", 2)
    return stack("", 2)


def _load(folder):
    cfg = T.AutoConfig.from_pretrained(folder)
    return getattr(T, cfg.architectures[0]).from_pretrained(folder, dtype=torch.float32).eval()


def _norm(folder):
    with CheckpointReader(folder) as r:
        return sum(float((t.double() ** 2).sum()) for _, t in r.iter_tensors() if t.is_floating_point()) ** 0.5


@pytest.mark.parametrize("family", FAMILIES)
def test_matched_model_computes_what_source_computes(family, tmp_path):
    src = save_tiny(tmp_path / "src", family, seed=1, head=_head(family))
    anc = save_tiny(tmp_path / "anc", family, seed=2, head=_head(family))
    report = match_checkpoints(src, anc, tmp_path / "out", symmetries=SYMMETRIES)
    out = tmp_path / "out"
    assert report["max_abs_logit_diff"] <= 1e-4
    assert report["distance_after"] < report["distance_before"]
    assert {r["module"] for r in report["per_module"]} == _module_keys(family)
    assert all(r["distance_after"] <= r["distance_before"] + 1e-6 for r in report["per_module"])
    assert json.loads((out / REPORT_FILE).read_text())["distance_after"] == report["distance_after"]
    assert set(load_transforms(out / TRANSFORMS_FILE)) == {r["module"] for r in report["per_module"]}
    a, b = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    assert {k: v.shape for k, v in a.items()} == {k: v.shape for k, v in b.items()}
    # independent check of function preservation, on other inputs than the report's
    ma, mb = _load(src), _load(out)
    inputs = random_inputs(ma, batch=3, seq=9, seed=4)
    key = "logits_per_image" if family == "clip" else "logits"
    with torch.no_grad():
        ya, yb = getattr(ma(**inputs), key), getattr(mb(**inputs), key)
    assert (ya - yb).abs().max() <= 1e-4


@pytest.mark.parametrize(
    "family",
    ["bert", "llama", "deberta-v2", "electra", "qwen3", "gemma", "gemma2", "phi3", "albert", "t5", "t5-gated", "clip"],
)
def test_disguised_checkpoint_is_recovered(family, tmp_path):
    src = save_tiny(tmp_path / "src", family, seed=3, head=_head(family))
    disguise_checkpoint(src, tmp_path / "d", seed=11)
    report = match_checkpoints(tmp_path / "d", src, tmp_path / "m", symmetries=SYMMETRIES)
    assert report["distance_before"] > 1.0
    assert report["distance_after"] <= 1e-5 * _norm(src)
    assert report["max_abs_logit_diff"] <= 1e-4


@pytest.mark.parametrize("family", ["t5", "t5-gated", "clip"])
def test_multi_stack_disguise_keeps_the_function_and_is_recovered_to_1e_6(family, tmp_path):
    """T5 (encoder, decoder, cross-attention stacks) and CLIP (two towers): every module of every stack disguised
    with random exact transforms keeps the outputs to 1e-4 and matching undoes it to 1e-6 of the weights' norm."""
    src = save_tiny(tmp_path / "src", family, seed=3, head=_head(family))
    disguise_checkpoint(src, tmp_path / "d", seed=11)
    ma, md = _load(src), _load(tmp_path / "d")
    inputs = random_inputs(ma, batch=3, seq=9, seed=2)
    key = "logits_per_image" if family == "clip" else "logits"
    with torch.no_grad():
        assert (getattr(ma(**inputs), key) - getattr(md(**inputs), key)).abs().max() <= 1e-4
    report = match_checkpoints(tmp_path / "d", src, tmp_path / "m", symmetries=SYMMETRIES)
    assert report["distance_before"] > 0.5 * _norm(src)
    assert report["distance_after"] <= 1e-6 * _norm(src), report["distance_after"] / _norm(src)
    assert report["max_abs_logit_diff"] <= 1e-4
    assert {r["module"] for r in report["per_module"]} == _module_keys(family)


def test_qwen3_match_logs_that_qk_maps_are_skipped(tmp_path, caplog):
    src = save_tiny(tmp_path / "src", "qwen3", seed=3, head="lm")
    disguise_checkpoint(src, tmp_path / "d", seed=2)
    with caplog.at_level("INFO", logger="symfuse.match.checkpoints"):
        report = match_checkpoints(tmp_path / "d", src, tmp_path / "m", symmetries=SYMMETRIES)
    assert "qwen3: per-head q/k norms make QK maps (rotations, scalings, invertible maps) inexact" in caplog.text
    assert report["distance_after"] <= 1e-6 * _norm(src) and report["max_abs_logit_diff"] <= 1e-4


def test_assemble_from_transform_files_equals_match(tmp_path):
    src = save_tiny(tmp_path / "src", "gpt2", seed=1, head="lm")
    anc = save_tiny(tmp_path / "anc", "gpt2", seed=2, head="lm")
    files = {}
    for key in ("L00.attn", "L00.ffn", "L01.attn", "L01.ffn"):
        t = match_module(src, anc, key, SYMMETRIES)
        files[key] = save_transform(t, tmp_path / f"{key}.safetensors")
        assert load_transform(files[key]).key == key
    report = assemble_matched(src, files, tmp_path / "a", anchor=anc)
    match_checkpoints(src, anc, tmp_path / "b", symmetries=SYMMETRIES)
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)
    assert report["max_abs_logit_diff"] <= 1e-4


def test_real_minilm_disguise_and_match(tmp_path):
    minilm = resolve_checkpoint("minilm")
    disguise_checkpoint("minilm", tmp_path / "d", seed=1)
    report = match_checkpoints(tmp_path / "d", "minilm", tmp_path / "m", symmetries=SYMMETRIES)
    assert report["family"] == "bert"
    assert report["max_abs_logit_diff"] <= 1e-4
    assert report["distance_after"] <= 1e-5 * _norm(minilm) < report["distance_before"]
    assert (tmp_path / "m" / "vocab.txt").exists() or (tmp_path / "m" / "tokenizer.json").exists()


@pytest.mark.parametrize("mode", ["closest", "barycenter"])
def test_match_many_aligns_disguised_copies(mode, tmp_path):
    base = save_tiny(tmp_path / "base", "bert", seed=5)
    models = [base] + [disguise_checkpoint(base, tmp_path / f"d{i}", seed=i) for i in (1, 2)]
    res = match_many(models, anchor=mode, symmetries=SYMMETRIES)
    assert res["anchor"] == ("barycenter" if mode == "barycenter" else res["anchor"])
    outs = [
        assemble_matched(m, res["transforms"][i], tmp_path / f"o{i}", logit_check=True) for i, m in enumerate(models)
    ]
    assert all(o["max_abs_logit_diff"] <= 1e-4 for o in outs)
    w = [load_file(tmp_path / f"o{i}" / "model.safetensors") for i in range(3)]
    for k in w[0]:
        for other in w[1:]:
            torch.testing.assert_close(other[k], w[0][k], rtol=0, atol=1e-4)


def test_match_module_many_aligns_every_module_to_the_barycenter(tmp_path):
    # per-module barycenter (the pipeline's task): disguised noisy copies, every model transformed, function kept
    base = save_tiny(tmp_path / "base", "bert", seed=5)
    models = [disguise_checkpoint(base, tmp_path / f"d{i}", seed=i, noise=0.01) for i in (1, 2, 3)]
    with CheckpointReader(base) as r:
        keys = [ref.key for ref in r.modules()]
    per_model = [{} for _ in models]
    for key in keys:
        for i, t in enumerate(match_module_many(models, key, SYMMETRIES)):
            per_model[i][key] = t
    outs = [assemble_matched(m, per_model[i], tmp_path / f"o{i}", logit_check=True) for i, m in enumerate(models)]
    assert all(o["max_abs_logit_diff"] <= 1e-4 for o in outs)
    w = [load_file(tmp_path / f"o{i}" / "model.safetensors") for i in range(3)]
    before = [load_file(m / "model.safetensors") for m in models]
    for k in w[0]:
        if "encoder.layer" in k and k.endswith("weight") and w[0][k].dim() == 2:
            spread = max(float((o[k] - w[0][k]).norm()) for o in w[1:])
            raw = max(float((o[k] - before[0][k]).norm()) for o in before[1:])
            assert spread <= 0.05 * raw, k  # aligned copies differ by the 1 % noise only, the disguised ones a lot


@pytest.mark.parametrize("family", FAMILIES)
def test_disguised_source_matches_onto_the_anchor_like_the_source(family, tmp_path):
    # S and a disguised copy T.S (random exact transforms of every kind) are one function: both matched onto an
    # unrelated anchor give the same checkpoint, and each keeps S's function
    src = save_tiny(tmp_path / "src", family, seed=1, head=_head(family))
    anc = save_tiny(tmp_path / "anc", family, seed=2, head=_head(family))
    disguise_checkpoint(src, tmp_path / "d", seed=7)
    r1 = match_checkpoints(src, anc, tmp_path / "m1", symmetries=SYMMETRIES)
    r2 = match_checkpoints(tmp_path / "d", anc, tmp_path / "m2", symmetries=SYMMETRIES)
    assert r1["max_abs_logit_diff"] <= 1e-4 and r2["max_abs_logit_diff"] <= 1e-4
    a, b = load_file(tmp_path / "m1" / "model.safetensors"), load_file(tmp_path / "m2" / "model.safetensors")
    diff = sum(float(((a[k].double() - b[k].double()) ** 2).sum()) for k in a) ** 0.5
    assert diff <= 1e-6 * _norm(tmp_path / "m1"), diff
    assert abs(r1["distance_after"] - r2["distance_after"]) <= 1e-6 * r1["distance_after"]


def test_tensors_outside_the_modules_copied_in_small_row_blocks_give_the_same_files(tmp_path, monkeypatch):
    # the embeddings and heads are copied block by block (finiteness, distance to the anchor, write at an offset);
    # with 7-element blocks every such tensor takes many blocks and a partial last one
    from symfuse.match import pipeline

    src = save_tiny(tmp_path / "src", "bert", seed=1, head="seq")
    anc = save_tiny(tmp_path / "anc", "bert", seed=2, head="seq")
    whole = match_checkpoints(src, anc, tmp_path / "whole", symmetries=SYMMETRIES)
    monkeypatch.setattr(pipeline, "ROW_BLOCK", 7)
    blocks = match_checkpoints(src, anc, tmp_path / "blocks", symmetries=SYMMETRIES)
    a = (tmp_path / "whole" / "model.safetensors").read_bytes()
    assert a == (tmp_path / "blocks" / "model.safetensors").read_bytes()
    assert blocks["distance_before"] == pytest.approx(whole["distance_before"], rel=1e-9)
    assert blocks["distance_after"] == pytest.approx(whole["distance_after"], rel=1e-9)
    assert whole["distance_after"] < whole["distance_before"]
