import json
import re

import pytest
import torch

from symfuse.errors import CheckpointError
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


def test_targets_follow_the_heads_class_names_not_their_positions(tmp_path):
    """One classifier saved twice, its head rows (and id2label) in two orders: by name one function, one loss."""
    from transformers import AutoModelForSequenceClassification

    from symfuse.data import load_task_dataset
    from symfuse.data.dataset import DatasetError

    base = save_tiny_base(tmp_path / "base")
    data = list(load_task_dataset("dair_emotion").labels)
    names = data[::-1]
    assert names != data  # the head's order is not the dataset's
    torch.manual_seed(3)
    model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=6, id2label=dict(enumerate(names)))
    model.save_pretrained(tmp_path / "reversed")
    order = [names.index(n) for n in data]  # the dataset's order, as rows of the reversed head
    with torch.no_grad():
        model.classifier.weight.copy_(model.classifier.weight[order].clone())
        model.classifier.bias.copy_(model.classifier.bias[order].clone())
    model.config.id2label, model.config.label2id = dict(enumerate(data)), {n: i for i, n in enumerate(data)}
    model.save_pretrained(tmp_path / "dataset-order")
    losses = {}
    for m in ("reversed", "dataset-order"):
        for f in ("vocab.txt", "tokenizer.json", "tokenizer_config.json"):
            (tmp_path / m / f).write_bytes((base / f).read_bytes())
        r = loss_barrier(tmp_path / m, tmp_path / m, "dair_emotion", tmp_path / f"out-{m}", points=2, max_examples=32,
                         max_length=32)  # fmt: skip
        losses[m] = r["losses"][0]
    assert losses["reversed"] == pytest.approx(losses["dataset-order"], rel=1e-5), losses
    with pytest.raises(CheckpointError, match="their heads name their classes differently"):
        loss_barrier(tmp_path / "reversed", tmp_path / "dataset-order", "dair_emotion", tmp_path / "o", points=2)
    few = AutoModelForSequenceClassification.from_pretrained(base, num_labels=6, id2label=dict(enumerate(
        ["anger", "fear", "joy", "love", "sadness", "calm"])))  # fmt: skip
    few.save_pretrained(tmp_path / "few")
    for f in ("vocab.txt", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "few" / f).write_bytes((base / f).read_bytes())
    with pytest.raises(DatasetError, match=r"dair_emotion on .*few: classes the head lacks: surprise \(its classes"):
        loss_barrier(tmp_path / "few", tmp_path / "few", "dair_emotion", tmp_path / "o", points=2)
    assert not (tmp_path / "o").exists()


def test_heads_of_two_label_sets_are_refused_naming_both_models(tmp_path):
    from symfuse.errors import CheckpointError
    from tests.tiny import save_tiny_text_classifier

    two = save_tiny_text_classifier(tmp_path / "two", seed=1, num_labels=2)
    three = save_tiny_text_classifier(tmp_path / "three", seed=2, num_labels=3)
    with pytest.raises(CheckpointError) as info:  # was "classifier.weight: shapes ... differ", naming neither
        loss_barrier(two, three, "dair_emotion", tmp_path / "out", points=3, max_examples=8)
    msg = str(info.value)
    assert re.match(rf"{re.escape(str(three))}: classifier\.\w+ has shape \(3,?.*\), {re.escape(str(two))} \(2", msg), (
        msg
    )
    assert msg.endswith("the barrier interpolates two models of one architecture and one label set")
    assert not (tmp_path / "out").exists()


def test_bare_encoder_is_refused_for_evaluation():
    from symfuse.errors import CheckpointError
    from symfuse.evaluate import load_task_model

    with pytest.raises(CheckpointError, match="no trained task head"):
        load_task_model("minilm")


def test_a_causal_language_model_is_named_as_one_when_classification_data_needs_a_head(tmp_path):
    """It was told 'no trained task head (score.weight missing)', as if a classifier had lost its weights."""
    import shutil

    from symfuse.checkpoint import resolve_checkpoint
    from symfuse.errors import CheckpointError
    from symfuse.evaluate import load_task_model
    from tests.tiny import save_tiny

    lm = save_tiny(tmp_path / "lm", "llama", head="lm", vocab_size=30522)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt"):
        shutil.copy2(resolve_checkpoint("minilm") / name, lm / name)
    text = r"lm: a causal language model \(LlamaForCausalLM\) has no classification head for this data — evaluate it"
    with pytest.raises(CheckpointError, match=text + " on language-modelling data"):
        load_task_model(lm)


def test_models_of_two_families_are_named_by_their_families(tmp_path):
    """A bert and a roberta classifier were refused with five tensor names of the one the other lacks."""
    from symfuse.checkpoint import CheckpointReader
    from symfuse.io import tensor_difference
    from tests.tiny import save_tiny

    bert, roberta = (save_tiny(tmp_path / f, f, head="seq") for f in ("bert", "roberta"))
    with CheckpointReader(bert) as a, CheckpointReader(roberta) as b:
        assert tensor_difference(a, b) == f"{roberta}: a roberta model, {bert} a bert model"
