import json

import pytest
import torch

from symfuse.evaluate import barrier_from_losses, default_lambdas, interpolation_losses, loss_barrier
from tests.symfuse.train.helpers import save_tiny_base


def test_default_lambdas():
    lam = default_lambdas(21)
    assert len(lam) == 21 and lam[0] == 0.0 and lam[-1] == 1.0 and lam[1] == pytest.approx(0.05)


def test_barrier_closed_form_on_a_concave_loss():
    torch.manual_seed(0)
    a, b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    before = {k: v.clone() for k, v in a.state_dict().items()}
    d2 = sum(((b.state_dict()[k] - v) ** 2).sum() for k, v in a.state_dict().items()).item()

    def loss(m):  # -|θ|²: the straight path bulges by λ(1-λ)|θ_B-θ_A|² above the chord
        return -sum((p**2).sum() for p in m.parameters()).item()

    lam = default_lambdas(21)
    losses = interpolation_losses(a, b, loss, lam)
    out = barrier_from_losses(lam, losses)
    assert out["argmax_lambda"] == 0.5 and out["barrier"] == pytest.approx(d2 / 4, rel=1e-5)
    assert all(torch.equal(v, a.state_dict()[k]) for k, v in before.items())  # inputs untouched
    # state dicts in, template module given
    losses_sd = interpolation_losses(a.state_dict(), b.state_dict(), loss, lam, template=torch.nn.Linear(3, 2))
    assert losses_sd == pytest.approx(losses)
    with pytest.raises(ValueError, match="template"):
        interpolation_losses(a.state_dict(), b.state_dict(), loss, lam)
    with pytest.raises(ValueError, match="shapes"):
        interpolation_losses(a, torch.nn.Linear(3, 4), loss, lam)


def test_barrier_of_a_model_with_itself_is_zero(tmp_path):
    from transformers import AutoModelForSequenceClassification

    base = save_tiny_base(tmp_path / "base")
    model = AutoModelForSequenceClassification.from_pretrained(
        base, num_labels=6, id2label=dict(enumerate(["anger", "fear", "joy", "love", "sadness", "surprise"]))
    )
    model.save_pretrained(tmp_path / "m")
    for f in ("vocab.txt", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "m" / f).write_bytes((base / f).read_bytes())
    r = loss_barrier(
        tmp_path / "m", tmp_path / "m", "dair_emotion", tmp_path / "out", points=5, max_examples=16, max_length=32
    )
    assert r["barrier"] == 0.0 and len(r["losses"]) == 5 and len(set(r["losses"])) == 1
    assert json.loads((tmp_path / "out" / "barrier.json").read_text())["barrier"] == 0.0
    assert (tmp_path / "out" / "barrier.png").read_bytes()[:4] == b"\x89PNG"


def test_heads_of_two_label_sets_are_refused_naming_both_models(tmp_path):
    from symfuse.errors import CheckpointError
    from tests.tiny import save_tiny_text_classifier

    two = save_tiny_text_classifier(tmp_path / "two", seed=1, num_labels=2)
    three = save_tiny_text_classifier(tmp_path / "three", seed=2, num_labels=3)
    with pytest.raises(CheckpointError) as info:  # was "classifier.weight: shapes ... differ", naming neither
        loss_barrier(two, three, "dair_emotion", tmp_path / "out", points=3, max_examples=8)
    assert str(info.value).startswith(f"{two} and {three}: classifier.bias has shape (2,) in one, (3,) in the other")
    assert not (tmp_path / "out").exists()


def test_bare_encoder_is_refused_for_evaluation():
    from symfuse.errors import CheckpointError
    from symfuse.evaluate import load_task_model

    with pytest.raises(CheckpointError, match="no trained task head"):
        load_task_model("minilm")
