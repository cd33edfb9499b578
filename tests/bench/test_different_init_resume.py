"""bench/different_init.py pretrain: a run killed (or stopped) and resumed ends bitwise equal to a straight run.

Tiny configuration on the CPU: a 2-layer BERT of width 16 over a 40-token vocabulary and 22 random blocks (the
corpus, tokenizer and vocabulary are replaced), batch 4, 12 steps, a save every 4 steps; the epoch order is
redrawn at step 6, so the data generator's state and the position in the order both matter.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
TINY_MODEL = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32)
RUN = ["--seed", "3", "--steps", "12", "--batch", "4", "--lr", "3e-3", "--warmup", "0.25", "--eval-every", "4"]
RUN += ["--eval-blocks", "4", "--threads", "1"]
FILES = {"config.json", "model.safetensors", "history.json", "run.json", "resume.safetensors"}


class Killed(Exception):
    """Stands in for the process being killed in the middle of a step."""


@pytest.fixture
def di(monkeypatch):
    """The script with a tiny model and a tiny random corpus in place of the shared datasets."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    corpus = importlib.import_module("different_init_corpus")
    module = importlib.import_module("different_init")
    n_tok = 40
    voc = corpus.Vocab(torch.arange(n_tok), torch.arange(n_tok))
    g = torch.Generator().manual_seed(0)
    data = {s: torch.randint(5, n_tok, (n, corpus.SEQ), generator=g) for s, n in (("train", 22), ("validation", 4))}
    for x in data.values():
        x[:, 0], x[:, -1] = voc.cls, voc.sep
    monkeypatch.setattr(corpus, "MODEL", TINY_MODEL)
    monkeypatch.setattr(module, "tokenizer", lambda: None)
    monkeypatch.setattr(module, "vocab", lambda tok, min_count: voc)
    monkeypatch.setattr(module, "blocks", lambda split, tok, v: data[split])
    threads = torch.get_num_threads()
    yield module
    torch.set_num_threads(threads)


def pretrain(di, monkeypatch, out: Path, *extra: str) -> None:
    monkeypatch.setattr(sys, "argv", ["different_init.py", "pretrain", *RUN, "--out", str(out), *extra])
    di.main()


def kill_after(di, monkeypatch, steps: int) -> None:
    """Make the optimiser step number ``steps + 1`` raise :class:`Killed` (``steps`` steps complete)."""
    real, calls = di.optimizer_step, []

    def step(*args):
        calls.append(1)
        if len(calls) > steps:
            raise Killed
        real(*args)

    monkeypatch.setattr(di, "optimizer_step", step)


def weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "model.safetensors")


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def losses(out: Path) -> list[tuple]:
    return [
        (r["step"], r["lr"], r["train_loss"], r["held_loss"]) for r in json.loads((out / "history.json").read_text())
    ]


def test_killed_then_resumed_equals_straight_run(di, monkeypatch, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    pretrain(di, monkeypatch, straight)
    with monkeypatch.context() as m:
        kill_after(di, m, 7)  # saves after steps 1 and 4: the state is at step 4, steps 5-7 are lost
        with pytest.raises(Killed):
            pretrain(di, m, resumed)
    assert losses(resumed) == losses(straight)[:2]
    assert not any(p.name.startswith(".") for p in resumed.iterdir()), "a temp file was left behind"
    pretrain(di, monkeypatch, resumed)
    assert json.loads((resumed / "run.json").read_text())["resumed_at"] == [4]
    assert_bitwise_equal(weights(resumed), weights(straight))
    assert losses(resumed) == losses(straight)  # same records: train / held-out losses and learning rates
    assert {p.name for p in resumed.iterdir()} == FILES == {p.name for p in straight.iterdir()}
    before = weights(straight)
    pretrain(di, monkeypatch, straight)  # the same command on a finished run: nothing more to do
    assert_bitwise_equal(weights(straight), before)
    assert json.loads((straight / "run.json").read_text())["resumed_at"] == [12]


def test_stopped_then_resumed_equals_straight_run(di, monkeypatch, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    pretrain(di, monkeypatch, straight)
    pretrain(di, monkeypatch, resumed, "--stop-after", "6")  # the state is at step 6, the order redrawn at step 6
    half, full = weights(resumed), weights(straight)
    assert not all(torch.equal(half[k], full[k]) for k in full)  # 6 steps are still to go
    pretrain(di, monkeypatch, resumed, "--resume")
    assert_bitwise_equal(weights(resumed), weights(straight))
    assert losses(resumed)[-1] == losses(straight)[-1]


def test_resume_refuses_a_state_of_other_options_and_a_missing_state(di, monkeypatch, tmp_path, capsys):
    out = tmp_path / "run"
    pretrain(di, monkeypatch, out, "--stop-after", "4")
    before = (out / "resume.safetensors").read_bytes()
    with pytest.raises(SystemExit) as e:
        pretrain(di, monkeypatch, out, "--lr", "1e-3")
    msg = str(e.value.code)
    assert msg.startswith("error: ") and "resume.safetensors" in msg and "(lr)" in msg and "\n" not in msg
    assert (out / "resume.safetensors").read_bytes() == before  # left as it was
    with pytest.raises(SystemExit) as e:  # the thread count changes the bits: resumed only with the same one
        pretrain(di, monkeypatch, out, "--threads", "2")
    assert "(threads)" in str(e.value.code)
    with pytest.raises(SystemExit) as e:
        pretrain(di, monkeypatch, out, "--stop-after", "2")
    assert "past --stop-after 2" in str(e.value.code)
    with pytest.raises(SystemExit) as e:
        pretrain(di, monkeypatch, tmp_path / "fresh", "--resume")
    assert "no resume state" in str(e.value.code) and not (tmp_path / "fresh").exists()
