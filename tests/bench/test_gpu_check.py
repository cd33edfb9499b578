"""bench/gpu_check.py's CPU parts: the parity machinery against itself, the report, the refusal without CUDA."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import gpu_check  # noqa: E402
import gpu_parity  # noqa: E402


def test_parity_of_the_cpu_with_itself_is_exact(tmp_path):
    rows = gpu_parity.match_parity(tmp_path, "cpu", "cpu", families=("llama",))
    assert len(rows) == 5 and all(r["ok"] and r["max_rel"] == 0.0 for r in rows)
    assert all(r["logit_diff"][0] < 1e-4 for r in rows)  # each match kept the model's function


def test_merge_parity_covers_every_registered_strategy(tmp_path):
    from symfuse.checkpoint import resolve_checkpoint
    from symfuse.merge import MERGERS

    rows = gpu_parity.merge_parity(tmp_path, "cpu", "cpu", Path(resolve_checkpoint("minilm")))
    merged = {r["what"] for r in rows if r["check"] == "merge"}
    assert merged == set(MERGERS.names()) and all(r["ok"] and r["max_rel"] == 0.0 for r in rows)


def test_max_rel_finds_the_worst_tensor():
    a = {"x": torch.ones(4), "y": torch.ones(4)}
    b = {"x": torch.ones(4), "y": torch.tensor([1.0, 1.0, 1.0, 3.0])}
    rel, where = gpu_parity.max_rel(a, b)
    assert where == "y" and rel == pytest.approx(1.0)
    zero = {"w": torch.full((4,), 100.0), "kb": torch.zeros(4)}  # rounding noise on a tensor that is 0 by maths
    noisy = {"w": torch.full((4,), 100.0), "kb": torch.full((4,), 1e-9)}
    assert gpu_parity.max_rel(zero, noisy)[0] == pytest.approx(1e-5)  # 2e-9 against 1e-6 of the state (200)


def test_report_is_one_table_per_section_with_errors_shown():
    results = {
        "environment": {"gpu": "X", "torch": "t", "cuda": "c", "transformers": "tr", "python": "p",
                        "cpu_threads": 1, "commit": "abc"},
        "parity": [{"check": "merge", "what": "ties", "max_rel": 1e-7, "tol": 1e-5, "ok": True}],
        "llama": [{"error": "OOM", "trace": "Traceback ... OOM"}],
        "seconds": 3.0,
    }  # fmt: skip
    text = gpu_check.report(results)
    assert "| merge | ties | 1e-07 | 1e-05 | True |" in text
    assert "## llama" in text and "Traceback ... OOM" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_without_cuda_the_check_is_one_line_and_exit_2(tmp_path):
    proc = subprocess.run([sys.executable, str(BENCH / "gpu_check.py"), "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, check=False)  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: bench/gpu_check.py: torch sees no CUDA device — run it on a GPU machine"
    ]
    assert not (tmp_path / "o").exists()


def test_lora_parity_of_the_cpu_with_itself_is_exact(tmp_path):
    rows = gpu_parity.lora_parity(tmp_path, "cpu", "cpu")
    assert len(rows) == 4 and all(r["ok"] and r["max_rel"] == 0.0 for r in rows)
