"""bench/lmc_train.py on a tiny configuration (d 32, 2 heads, batch 2, 8 steps) and a tiny cut of the corpus, CPU."""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import GPT2LMHeadModel

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "lmc_train.py"
CORPUS = REPO / "bench" / "data" / "tinyshakespeare"
TINY = ["--d-model", "32", "--heads", "2", "--batch-size", "2", "--max-steps", "8", "--eval-every", "4"]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny tensors: one intra-op thread is as fast, and far faster when the cores are shared and busy."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def lmc():
    spec = importlib.util.spec_from_file_location("lmc_train", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """The first speeches of each split (a few hundred tokens of validation and test: one or two windows)."""
    folder = tmp_path_factory.mktemp("tinyshakespeare")
    for split, n in [("train", 200), ("validation", 20), ("test", 20)]:
        with open(CORPUS / f"{split}.jsonl") as f:
            (folder / f"{split}.jsonl").write_text("".join(itertools.islice(f, n)))
    return folder


def tiny_args(data: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--seed", "0", "--out", str(out), "--data", str(data), "--device", "cpu", *TINY, *extra]


@pytest.fixture(scope="module")
def finished(lmc, data, tmp_path_factory) -> Path:
    """One uninterrupted tiny run."""
    out = tmp_path_factory.mktemp("runs") / "seed0"
    assert lmc.main(tiny_args(data, out)) == 0
    return out


def test_run_writes_a_loadable_model_whose_log_describes_the_file(lmc, data, finished):
    assert sorted(p.name for p in finished.parent.iterdir()) == ["seed0"]  # no state or temp folder left
    assert (finished / "tokenizer.json").read_bytes() == lmc.TOKENIZER.read_bytes()
    log = json.loads((finished / "train_log.json").read_text())
    assert [e["step"] for e in log["evals"]] == [4, 8]
    assert log["best_val_loss"] == min(e["val_loss"] for e in log["evals"])
    assert log["config"]["d_model"] == 32 and log["seed"] == 0 and log["device"] == "cpu"
    assert "lmc_train.py train --seed 0" in log["command"]
    model = GPT2LMHeadModel.from_pretrained(finished, dtype=torch.float32)
    assert (model.config.n_embd, model.config.n_head, model.config.n_layer, model.config.vocab_size) == (32, 2, 6, 4096)
    test_ids = lmc.token_stream(Tokenizer.from_file(str(finished / "tokenizer.json")), data, "test")
    assert log["tokens"]["test"] == len(test_ids)
    assert math.isclose(lmc.eval_loss(model, test_ids, torch.device("cpu")), log["test_loss"], rel_tol=1e-6)


def test_resumed_run_ends_with_the_same_weights_bit_for_bit(lmc, data, finished, tmp_path):
    out = tmp_path / "seed0"
    assert lmc.main(tiny_args(data, out, "--stop-after-steps", "6")) == 0  # a kill after the step-4 checkpoint
    assert not out.exists() and (tmp_path / ".seed0.state" / "state.json").exists()
    assert lmc.main(tiny_args(data, out)) == 0
    assert not (tmp_path / ".seed0.state").exists()
    log, reference_log = (json.loads((d / "train_log.json").read_text()) for d in (out, finished))
    assert log["resumed_at"] == [4]
    assert [e["val_loss"] for e in log["evals"]] == [e["val_loss"] for e in reference_log["evals"]]
    resumed, reference = load_file(out / "model.safetensors"), load_file(finished / "model.safetensors")
    assert resumed.keys() == reference.keys()
    assert all(torch.equal(resumed[k], reference[k]) for k in reference)


def test_existing_output_is_refused_without_overwrite(lmc, data, finished, capsys):
    before = (finished / "model.safetensors").read_bytes()
    assert lmc.main(tiny_args(data, finished)) == 2
    assert "exists" in capsys.readouterr().err
    assert (finished / "model.safetensors").read_bytes() == before


def test_all_skips_finished_runs_and_prints_the_table(lmc, data, finished, tmp_path, capsys):
    shutil.copytree(finished, tmp_path / "seed0")
    assert lmc.main(["all", "--out", str(tmp_path), "--seeds", "0", "--data", str(data), "--device", "cpu"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:2] == ["run", "best"] and table[1].split()[:3] == ["seed0", "8", "8"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["seed0"]  # nothing trained


def test_missing_cuda_device_is_one_error_line_and_exit_2(tmp_path):
    argv = [sys.executable, str(SCRIPT), "train", "--seed", "0", "--out", str(tmp_path / "x"), "--device", "cuda:7"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2
    assert done.stderr.startswith("error: --device cuda:7") and done.stderr.count("\n") == 1
    assert not (tmp_path / "x").exists()


def test_learning_rate_warms_up_then_decays_to_a_tenth(lmc):
    assert lmc.lr_at(0, 1.0, 10, 110) == pytest.approx(0.1)
    assert lmc.lr_at(9, 1.0, 10, 110) == pytest.approx(1.0)
    assert lmc.lr_at(60, 1.0, 10, 110) == pytest.approx(0.55)
    assert lmc.lr_at(110, 1.0, 10, 110) == pytest.approx(0.1)
