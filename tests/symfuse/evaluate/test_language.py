"""Causal LMs on language-modelling data: loss and perplexity (library and `symfuse evaluate`), and refusals."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from symfuse.checkpoint import resolve_checkpoint
from symfuse.data import load_task_dataset
from symfuse.data.files import DatasetError
from symfuse.errors import CheckpointError
from symfuse.evaluate import evaluate_model
from tests.cli.helpers import run_cli
from tests.tiny import save_tiny, save_tiny_text_classifier

TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
TEXTS = [
    "ROMEO: But soft, what light through yonder window breaks?",
    "JULIET: O Romeo, Romeo, wherefore art thou Romeo? Deny thy father and refuse thy name.",
    "NURSE: Anon!",
    "",  # an empty record: skipped
    "MERCUTIO: A plague o' both your houses! They have made worms' meat of me.",
    "FRIAR LAURENCE: These violent delights have violent ends and in their triumph die, like fire and powder.",
]


@pytest.fixture(scope="module")
def lm(tmp_path_factory) -> Path:
    """A tiny random Llama causal LM reading MiniLM's tokenizer (vocabulary 30522)."""
    folder = save_tiny(tmp_path_factory.mktemp("lm") / "llama", "llama", head="lm", seed=0, vocab_size=30522)
    for name in TOKENIZER_FILES:
        shutil.copy2(resolve_checkpoint("minilm") / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def speeches(tmp_path_factory) -> Path:
    """A language-modelling dataset folder: meta.json and a test split of speeches."""
    folder = tmp_path_factory.mktemp("data") / "speeches"
    folder.mkdir()
    (folder / "meta.json").write_text(json.dumps({"task": "language_modeling"}))
    (folder / "test.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    return folder


def _alone(lm: Path, max_length: int) -> tuple[float, int]:
    """The summed next-token NLL of each non-empty text run alone through transformers, and the tokens predicted."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(lm))
    net = AutoModelForCausalLM.from_pretrained(str(lm)).eval()
    total, count = 0.0, 0
    for text in filter(None, TEXTS):
        ids = tok(text, return_tensors="pt", truncation=True, max_length=max_length)["input_ids"]
        with torch.no_grad():
            logits = net(input_ids=ids).logits[0, :-1].double()
        total += float(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum"))
        count += ids.shape[1] - 1
    return total, count


@pytest.mark.parametrize("batch_size", [1, 4])
def test_loss_is_the_mean_next_token_nll_of_each_text_alone(lm, speeches, tmp_path, batch_size):
    m = evaluate_model(lm, str(speeches), batch_size=batch_size, max_length=16, out_file=tmp_path / "m.json")
    total, count = _alone(lm, 16)
    assert m["tokens"] == count and m["n"] == len([t for t in TEXTS if t])
    assert m["loss"] == pytest.approx(total / count, rel=1e-5)  # right padding changes nothing
    assert m["perplexity"] == pytest.approx(math.exp(total / count), rel=1e-5) and m["primary"] == "perplexity"
    assert json.loads((tmp_path / "m.json").read_text())["perplexity"] == m["perplexity"]


def test_a_random_model_is_near_the_uniform_perplexity_and_max_examples_subsamples(lm, speeches, tmp_path):
    m = evaluate_model(lm, str(speeches), max_examples=2, out_file=tmp_path / "m.json")
    assert m["n"] == 2
    assert 0.5 * 30522 < m["perplexity"] < 2 * 30522  # a random tiny LM predicts about uniformly


def test_a_model_whose_loss_overflows_is_refused_and_no_metrics_are_written(lm, speeches, tmp_path):
    """Its final norm x 1e36 (finite weights): an OverflowError of math.exp (the probe's model: "perplexity":
    Infinity with exit 0); x 1e38 the loss itself overflows."""
    from safetensors.torch import load_file, save_file

    from symfuse.errors import NonFiniteError

    big = shutil.copytree(lm, tmp_path / "big")
    weights = load_file(str(lm / "model.safetensors"))
    for scale, what in ((1e36, "perplexity"), (1e38, "next-token loss")):
        scaled = {**weights, "model.norm.weight": weights["model.norm.weight"] * scale}
        save_file(scaled, str(big / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(NonFiniteError, match=rf"^{big}: its {what} .*came out NaN / inf"):
            evaluate_model(big, str(speeches), out_file=tmp_path / "m.json")
        assert not (tmp_path / "m.json").exists()


def test_texts_are_cut_at_the_positions_the_model_reads(speeches, tmp_path):
    """A GPT-2 of 16 positions at the default max_length 128: an IndexError deep in its position embedding."""
    folder = save_tiny(tmp_path / "gpt2", "gpt2", head="lm", vocab_size=30522, n_positions=16)
    for name in TOKENIZER_FILES:
        shutil.copy2(resolve_checkpoint("minilm") / name, folder / name)
    m = evaluate_model(folder, str(speeches), out_file=tmp_path / "m.json")
    assert m["tokens"] <= 15 * m["n"] and math.isfinite(m["loss"])


def test_the_command_prints_and_writes_the_metrics(lm, speeches, tmp_path):
    proc = run_cli("evaluate", lm, "--data", speeches, "--max-length", "16", "--out", tmp_path / "e.json")
    assert proc.returncode == 0, proc.stderr
    printed = json.loads(proc.stdout)
    assert printed["task"] == "language_modeling" and printed["perplexity"] > 1
    assert json.loads((tmp_path / "e.json").read_text())["loss"] == printed["loss"]


def test_refusals_are_one_line(lm, speeches, tmp_path):
    classifier = save_tiny_text_classifier(tmp_path / "bert")
    cases = {
        ("evaluate", classifier, "--data", speeches): "is not a causal language model",
        ("evaluate", lm, "--data", speeches, "--labels-from", "meld"): "without labels — drop it",
        ("evaluate", lm, "--data", speeches, "--split", "train"): "no train split — it has test",
        ("stats", lm, "--data", speeches, "--kind", "gram", "--out", tmp_path / "s"): "and `inspect --data` read it",
    }
    for args, message in cases.items():
        proc = run_cli(*args)
        last = proc.stderr.strip().splitlines()[-1]
        assert proc.returncode != 0 and message in last and "Traceback" not in proc.stderr, (args, proc.stderr)
    with pytest.raises(CheckpointError, match="is not a causal language model"):
        evaluate_model(classifier, str(speeches), out_file=tmp_path / "x.json")
    with pytest.raises(DatasetError, match="a language-modelling dataset"):
        load_task_dataset(str(speeches))


def test_barrier_of_causal_lms_on_language_modelling_data(lm, speeches, tmp_path):
    from symfuse.evaluate import loss_barrier

    other = save_tiny(tmp_path / "other", "llama", head="lm", seed=1, vocab_size=30522)
    for name in TOKENIZER_FILES:
        shutil.copy2(lm / name, other / name)
    r = loss_barrier(lm, other, str(speeches), tmp_path / "b", points=3, max_length=16)
    total, count = _alone(lm, 16)
    assert r["losses"][0] == pytest.approx(total / count, rel=1e-5)  # λ = 0 is A's next-token loss
    same = loss_barrier(lm, lm, str(speeches), tmp_path / "same", points=3, max_length=16)
    assert abs(same["barrier"]) < 1e-6 and len(set(round(x, 6) for x in same["losses"])) == 1
    proc = run_cli("barrier", lm, other, "--data", speeches, "--points", "3", "--max-length", "16", "--out",
                   tmp_path / "cli")  # fmt: skip
    assert proc.returncode == 0 and (tmp_path / "cli" / "barrier.json").is_file(), proc.stderr


def test_inspect_scores_causal_lms_on_language_modelling_data(lm, speeches, tmp_path):
    other = save_tiny(tmp_path / "other", "llama", head="lm", seed=1, vocab_size=30522)
    for name in TOKENIZER_FILES:
        shutil.copy2(lm / name, other / name)
    proc = run_cli("inspect", lm, other, "--data", speeches, "--max-examples", "4")
    assert proc.returncode == 0, proc.stderr
    assert "loss along the path (causal_lm, 4 examples of the test split)" in proc.stdout
    classifier = save_tiny_text_classifier(tmp_path / "bert")
    twin = save_tiny_text_classifier(tmp_path / "bert2", seed=1)
    proc = run_cli("inspect", classifier, twin, "--data", speeches)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode != 0 and "language-modelling data scores causal LMs" in last, proc.stderr
    assert "Traceback" not in proc.stderr
