"""A model with finite weights whose activations overflow: evaluate, stats, barrier and inspect refuse it.

Each used to exit 0: evaluate with ``"loss": NaN`` and an accuracy read from argmax-of-NaN logits (perplexity
Infinity for a causal LM), stats with NaN Grams / Fishers (the merge then blamed a "corrupt file"), barrier and
inspect with a NaN barrier turned into a verdict.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from symfuse.errors import NonFiniteError
from symfuse.evaluate import evaluate_model
from symfuse.evaluate.barrier import loss_barrier
from symfuse.stats import collect_stats
from tests.cli.helpers import toy_dataset
from tests.tiny import save_tiny_text_classifier


def _scaled(src: Path, out: Path, suffix: str, scale: float) -> Path:
    """A copy of ``src`` whose tensors ending in ``suffix`` are multiplied by ``scale`` (every value stays finite)."""
    shutil.copytree(src, out)
    weights = load_file(str(src / "model.safetensors"))
    for name in weights:
        if name.endswith(suffix):
            weights[name] = weights[name] * scale
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("overflow")
    good = save_tiny_text_classifier(root / "good")
    big = _scaled(good, root / "big", "embeddings.LayerNorm.weight", 1e30)
    return good, big, toy_dataset(root / "data")


def test_evaluate_refuses_outputs_that_overflow_and_writes_no_metrics(models, tmp_path):
    good, big, data = models
    with pytest.raises(NonFiniteError, match=rf"^{big}: its outputs on data/test came out NaN / inf, though the "
                                             "weights are finite"):  # fmt: skip
        evaluate_model(big, str(data), labels_from=str(data), out_file=tmp_path / "m.json")
    assert not (tmp_path / "m.json").exists()
    metrics = evaluate_model(good, str(data), labels_from=str(data), out_file=tmp_path / "m.json")
    assert json.loads((tmp_path / "m.json").read_text())["accuracy"] == metrics["accuracy"]


def test_stats_refuse_statistics_that_overflow_and_write_nothing(models, tmp_path):
    _, big, data = models
    for kind in ("gram", "fisher"):
        with pytest.raises(NonFiniteError, match=rf"^{big}: its (gram|Fisher) of .* came out NaN / inf"):
            collect_stats(big, str(data), [kind], tmp_path / kind, batch_size=4, progress=False)
        assert not (tmp_path / kind).exists()


def test_a_barrier_through_an_overflowing_model_is_refused(models, tmp_path):
    good, big, data = models
    with pytest.raises(NonFiniteError, match=rf"^{good} -> {big}: the loss at λ=0.50 \(λ=0 is the first model\)"):
        loss_barrier(good, big, str(data), tmp_path / "b", points=3)
    assert not (tmp_path / "b" / "barrier.json").exists()
