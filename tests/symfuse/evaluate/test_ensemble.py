"""Per-dataset heads voting out of domain: closed form of the vote, one head = that head, the task picks the voters."""

from __future__ import annotations

import json
import math

import pytest
import torch

from symfuse.evaluate import evaluate_model
from symfuse.evaluate.ensemble import evaluate_heads, vote
from symfuse.train import FinetuneConfig, finetune
from tasks.evaluate import pick_heads
from tests.symfuse.train.helpers import save_tiny_base


def test_vote_is_the_mean_probability_over_the_heads_that_have_the_class():
    a = (["joy", "anger", "love"], torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]]))
    b = (["Anger", "fear"], torch.tensor([[1.0, 0.0], [0.0, 2.0]]))
    got = vote([a, b], ["anger", "fear", "joy"]).exp()
    pa, pb = torch.softmax(a[1].double(), -1), torch.softmax(b[1].double(), -1)
    expected = torch.stack(
        [
            (pa[:, 1] + pb[:, 0]) / 2,  # anger: both heads
            pb[:, 1],  # fear: only b (a abstains, it does not vote 0)
            pa[:, 0],  # joy: only a
        ],
        dim=1,
    )
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    # a head's mass on a class the dataset lacks (love) lowers its votes: probabilities are over the head's own classes
    assert got[0, 2] == pytest.approx(math.exp(0.0) / (1 + math.e + math.e**2))
    with pytest.raises(ValueError, match="surprise"):
        vote([a, b], ["surprise"])
    # a multi-label head votes its sigmoid per class
    multi = vote([a, b], ["anger", "fear", "joy"], multi=[False, True]).exp()
    torch.testing.assert_close(multi[:, 1], torch.sigmoid(b[1][:, 1].double()), rtol=0, atol=1e-12)
    torch.testing.assert_close(multi[:, 0], (pa[:, 1] + torch.sigmoid(b[1][:, 0].double())) / 2, rtol=0, atol=1e-12)


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    base = save_tiny_base(root / "base")
    cfg = FinetuneConfig(epochs=1, lr=1e-3, batch_size=8, max_length=32, max_train_examples=32,
                         max_eval_examples=16, progress=False)  # fmt: skip
    return {n: finetune(base, n, root / n, cfg) for n in ("isear", "meld", "crowdflower")}


def test_one_head_votes_like_itself_and_heads_without_shared_classes_stay_out(heads, tmp_path):
    kw = dict(max_examples=40, max_length=32)
    alone = evaluate_model(heads["meld"], "goemotions_ekman", out_file=tmp_path / "a.json", in_domain=False, **kw)
    assert alone["classes"] == ["anger", "disgust", "fear", "joy", "sadness", "surprise"]  # shared Ekman, no neutral
    voted = evaluate_heads([heads["meld"]], "goemotions_ekman", out_file=tmp_path / "v.json", **kw)
    assert voted["macro_f1"] == pytest.approx(alone["macro_f1"], abs=1e-12)
    assert voted["per_class_f1"] == pytest.approx(alone["per_class_f1"], abs=1e-12) and voted["n"] == alone["n"]
    assert json.loads((tmp_path / "v.json").read_text())["heads"] == [str(heads["meld"])]


def test_two_heads_vote_by_hand(heads, tmp_path):
    """The written metric equals scoring the hand-made vote of the two heads' own logits."""
    from symfuse.data import load_task_dataset
    from symfuse.evaluate import score_logits
    from symfuse.evaluate.ensemble import _head_logits

    kw = dict(max_examples=40, max_length=32)
    got = evaluate_heads([heads["isear"], heads["meld"]], "goemotions_ekman", out_file=tmp_path / "v.json", **kw)
    ds = load_task_dataset("goemotions_ekman")
    how = dict(split="test", device="cpu", batch_size=64, seed=13, **kw)
    (na, za, gold, _), (nb, zb, _, _) = (_head_logits(heads[n], ds, how) for n in ("isear", "meld"))
    classes = got["head_labels"]
    assert set(classes) == {"anger", "disgust", "fear", "joy", "sadness", "surprise"}
    scores = vote([(na, za), (nb, zb)], classes)
    want = score_logits(ds, classes, "single_label_classification", [scores.float()], [gold], in_domain=False)
    assert got["macro_f1"] == pytest.approx(want["macro_f1"], abs=1e-12) and got["n"] == want["n"]


def test_the_task_picks_every_sharing_head_to_vote_or_the_closest(tmp_path):
    folder = tmp_path / "merged"
    fake = {"dair": ["sadness", "love"], "meld": ["anger", "joy", "neutral"], "sst": ["neg", "pos"]}
    for name, labels in fake.items():
        sub = folder / "heads" / name
        sub.mkdir(parents=True)
        (sub / "config.json").write_text(json.dumps({"id2label": dict(enumerate(labels))}))
    heads = {n: f"heads/{n}" for n in ("dair", "meld", "sst")}
    assert pick_heads(folder, heads, "meld", "meld", "vote") == [(folder / "heads/meld", "meld")]  # in domain
    voters = pick_heads(folder, heads, "goemotions_ekman", "goemotions_ekman", "vote")
    assert [h for _, h in voters] == ["dair", "meld"]  # sst shares no class
    closest = pick_heads(folder, heads, "goemotions_ekman", "goemotions_ekman", "closest")
    assert [h for _, h in closest] == ["meld"]  # anger + joy beat sadness alone
    assert pick_heads(folder, None, "x", "x", "vote") == [(folder, "")]
