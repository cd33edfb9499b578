"""``symfuse match`` checks its own result: per-module invariants while applying, streamed outputs, --verify."""

import json
import random

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import symfuse.cli.match  # noqa: F401  (registers the commands)
from symfuse.arch import ModuleRef
from symfuse.checkpoint import CheckpointReader, load_hf_model
from symfuse.cli import app
from symfuse.errors import CheckpointError, VerificationError
from symfuse.io.planned import PlannedFile
from symfuse.match import assemble_matched, match_checkpoints, pipeline
from symfuse.match.checkpoints import match_all_modules
from symfuse.match.output_check import _empty_model, _run_streaming, streaming_logit_diff
from symfuse.match.verify import check_module_transform, module_invariants
from symfuse.symmetry.random import ALL_KINDS, random_module_transform
from symfuse.symmetry.transforms import FFNPermutation, ModuleTransform, QKRotation
from tests.tiny import DECODERS, save_tiny

SYMS = ["rotation", "scaling", "ffn-permutation", "head-permutation"]


def _run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def _head(family):
    return "lm" if family in DECODERS else "seq"


# --------------------------------------------------------------------------------------------- planned files
def test_planned_file_is_byte_identical_to_save_file(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "b.w": torch.randn(3, 4, generator=g),
        "a.w": torch.randn(5, generator=g).half(),
        "ids": torch.arange(6),
        "s": torch.randn((), generator=g).double(),
        "e": torch.randn(7, generator=g).bfloat16(),
        "mask": torch.tensor([True, False]),
        "empty": torch.zeros(0, 3),
        "z.rows": torch.randn(9, 3, generator=g),
    }
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    pf = PlannedFile(tmp_path / "p.safetensors", {k: (v.dtype, v.shape) for k, v in tensors.items()}, {"format": "pt"})
    items = list(tensors.items())
    random.Random(1).shuffle(items)
    for name, t in items:
        if name == "z.rows":  # in row blocks, last block first
            pf.write(name, t[5:], 5)
            pf.write(name, t[:5])
        elif name != "empty":
            pf.write(name, t)
    pf.finish()
    assert (tmp_path / "p.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def test_planned_file_refuses_missing_and_wrong_tensors(tmp_path):
    pf = PlannedFile(tmp_path / "p.safetensors", {"a": (torch.float32, (2, 2)), "b": (torch.float32, (3,))})
    with pytest.raises(CheckpointError, match=r"'a'.*planned"):
        pf.write("a", torch.zeros(2, 3))
    with pytest.raises(CheckpointError, match="not one of the planned"):
        pf.write("c", torch.zeros(3))
    pf.write("a", torch.zeros(2, 2))
    with pytest.raises(CheckpointError, match=r"never written: \['b'\]"):
        pf.finish()
    pf.close()


# ------------------------------------------------------------------------------------------- module checks
@pytest.mark.parametrize("family", ["bert", "llama", "gpt2", "deberta-v2"])
def test_module_check_passes_exact_transforms_and_refuses_corrupted_ones(family, tmp_path):
    src = save_tiny(tmp_path / "src", family, seed=1, head=_head(family))
    g = torch.Generator().manual_seed(3)
    with CheckpointReader(src) as r:
        geo = r.geometry
        for ref in r.modules():
            w = r.read_module(ref)
            mt = random_module_transform(ref, geo, g, ALL_KINDS)
            new = mt.apply(w)
            assert check_module_transform(ref, w, new, geo, mt) < 1e-5
            # the invariants taken before the transform (the source module freed) give the same verdict
            inv = module_invariants(ref, w, geo)
            assert check_module_transform(ref, inv, new, geo, mt) == check_module_transform(ref, w, new, geo, mt)
            role = next(iter(w))
            with pytest.raises(VerificationError, match=rf"{ref.key}: role '{role}' is .* after the transform"):
                check_module_transform(ref, inv, {**new, role: new[role].double()}, geo, mt)
            if ref.kind == "attn":  # the rotation reaches the queries but not the keys
                rot = next(p for p in mt.parts if isinstance(p, QKRotation))
                bad = dict(new, q=QKRotation(rot.rot).apply(w)["q"])
                with pytest.raises(VerificationError, match=rf"{ref.key}: .*q.k scores head \d+"):
                    check_module_transform(ref, w, bad, geo, mt, "OUT")
                bad = dict(new, o=new["o"] * 1.01)
                with pytest.raises(VerificationError, match=rf"{ref.key}: .*V.O output"):
                    check_module_transform(ref, w, bad, geo, mt, "OUT")
                with pytest.raises(VerificationError, match=rf"{ref.key}: .*V.O output"):
                    check_module_transform(ref, inv, bad, geo, mt, "OUT")
            else:  # up rows permuted, down columns not
                perm = next(p for p in mt.parts if isinstance(p, FFNPermutation)).perm
                bad = dict(w, up=w["up"][perm])
                with pytest.raises(VerificationError, match=rf"^OUT: module {ref.key}: .*FFN output"):
                    check_module_transform(ref, w, bad, geo, ModuleTransform(ref.key, (FFNPermutation(perm),)), "OUT")


def test_match_refuses_a_wrong_apply_and_publishes_nothing(tmp_path, monkeypatch):
    src = save_tiny(tmp_path / "src", "bert", seed=1, head="seq")
    anc = save_tiny(tmp_path / "anc", "bert", seed=2, head="seq")

    def broken(self, weights):  # the up rows move, the down columns stay
        out = dict(weights)
        out["up"] = weights["up"][self.perm]
        return out

    monkeypatch.setattr(FFNPermutation, "apply", broken)
    with pytest.raises(VerificationError, match=r"module L0\d\.ffn: the transform changes the FFN output"):
        match_checkpoints(src, anc, tmp_path / "out", symmetries=SYMS)
    assert {p.name for p in tmp_path.iterdir()} == {"src", "anc"}  # no output, no temporary folder left


def test_default_output_check_catches_a_wrong_result_the_module_checks_missed(tmp_path, monkeypatch):
    src = save_tiny(tmp_path / "src", "bert", seed=1, head="seq")
    anc = save_tiny(tmp_path / "anc", "bert", seed=2, head="seq")
    real = FFNPermutation.apply
    monkeypatch.setattr(FFNPermutation, "apply", lambda self, w: {**real(self, w), "down": w["down"]})
    monkeypatch.setattr(pipeline, "check_module_transform", lambda *a, **k: 0.0)
    r = _run("match", src, anc, "--out", tmp_path / "out", "--symmetries", ",".join(SYMS))
    assert r.exit_code == 1
    assert "outputs differ from" in r.output and "nothing was published" in r.output
    assert not (tmp_path / "out").exists()
    # --verify none publishes what the module checks let through (they were switched off here)
    r = _run("match", src, anc, "--out", tmp_path / "out", "--symmetries", ",".join(SYMS), "--verify", "none")
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "out" / "symfuse_report.json").read_text())["max_abs_logit_diff"] is None


def test_verify_full_and_bad_mode(tmp_path):
    src = save_tiny(tmp_path / "src", "gpt2", seed=1, head="lm")
    anc = save_tiny(tmp_path / "anc", "gpt2", seed=2, head="lm")
    r = _run("match", src, anc, "--out", tmp_path / "f", "--verify", "full")
    assert r.exit_code == 0, r.output
    report = json.loads((tmp_path / "f" / "symfuse_report.json").read_text())
    assert report["verify"] == "full" and report["max_abs_logit_diff"] <= 1e-4
    r = _run("match", src, anc, "--out", tmp_path / "g", "--verify", "sometimes")
    assert r.exit_code == 2 and "--verify: 'sometimes'" in r.output
    assert not (tmp_path / "g").exists()


# ---------------------------------------------------------------------------------------- streamed outputs
@pytest.mark.parametrize("family", ["bert", "gpt2", "llama", "albert"])
def test_streamed_outputs_equal_loaded_ones_with_one_layer_in_memory(family, tmp_path):
    src = save_tiny(tmp_path / "src", family, seed=1, head=_head(family))
    other = save_tiny(tmp_path / "other", family, seed=2, head=_head(family))
    with CheckpointReader(src) as r:
        model = _empty_model(r.config)
        layers = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 1]
        live = []

        def count(_m, _a, _o):  # runs before the streamer's own hook releases the layer
            live.append(sum(not p.is_meta for lst in layers for p in lst.parameters()))

        for lst in layers:
            for layer in lst:
                layer.register_forward_hook(count)
        inputs = r.spec.random_inputs(r.config)
        streamed = _run_streaming(model, r, inputs)
        assert all(p.is_meta for p in model.parameters())  # everything released afterwards
    with torch.no_grad():
        out = load_hf_model(src, dtype=torch.float32)(**inputs)
    ref = out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state
    assert torch.allclose(streamed, ref, atol=1e-5)
    if family != "albert":  # each layer runs with its own parameters alone (ALBERT shares one: kept whole)
        per_layer = max(sum(1 for _ in layer.parameters()) for lst in layers for layer in lst)
        assert live and max(live) == per_layer
    diff, scale = streaming_logit_diff(src, other)
    assert diff > 1e-3 * scale  # different models are told apart
    assert streaming_logit_diff(src, src)[0] == 0.0


# ------------------------------------------------------------------------------------- same bytes as before
def test_one_pass_writes_the_same_shards_as_the_assembler(tmp_path):
    src = save_tiny(tmp_path / "src", "bert", seed=1, head="seq")
    anc = save_tiny(tmp_path / "anc", "bert", seed=2, head="seq")
    with CheckpointReader(src) as s, CheckpointReader(anc) as a:
        (tmp_path / "new").mkdir()
        ts, per_module, before, after = pipeline.match_and_write(s, a, tmp_path / "new", SYMS, shard_bytes=40_000)
        old_ts = match_all_modules(s, a, SYMS)
    report = assemble_matched(src, old_ts, tmp_path / "old", anchor=anc, shard_bytes=40_000, verify="none")
    files = sorted(p.name for p in (tmp_path / "old").glob("model*"))
    assert len(files) > 2 and files == sorted(p.name for p in (tmp_path / "new").glob("model*"))
    for f in files:
        assert (tmp_path / "new" / f).read_bytes() == (tmp_path / "old" / f).read_bytes(), f
    assert set(ts) == set(old_ts)
    for k in ts:
        assert all(torch.equal(x, y) for x, y in zip(ts[k].tensors().values(), old_ts[k].tensors().values()))
    assert before == pytest.approx(report["distance_before"], rel=1e-6)
    assert after == pytest.approx(report["distance_after"], rel=1e-5)
    assert [r["module"] for r in per_module] == [r["module"] for r in report["per_module"]]
    assert load_file(tmp_path / "new" / files[0]).keys() == load_file(tmp_path / "old" / files[0]).keys()
    assert ModuleRef.parse(per_module[0]["module"]).layer == 0
