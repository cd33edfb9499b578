"""Per-dataset heads voting out of domain: closed form of the vote, one head = that head, the task picks the voters."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from symfuse.evaluate import evaluate_model
from symfuse.evaluate.ensemble import evaluate_heads, vote
from tasks.evaluate import pick_heads


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
    from symfuse.evaluate.ensemble import _heads_logits

    kw = dict(max_examples=40, max_length=32)
    got = evaluate_heads([heads["isear"], heads["meld"]], "goemotions_ekman", out_file=tmp_path / "v.json", **kw)
    ds = load_task_dataset("goemotions_ekman")
    how = dict(split="test", device="cpu", batch_size=64, seed=13, **kw)
    (([ha], [za], gold), ([hb], [zb], _)) = (_heads_logits([heads[n]], ds, how) for n in ("isear", "meld"))
    na, nb = ha.names, hb.names
    classes = got["head_labels"]
    assert set(classes) == {"anger", "disgust", "fear", "joy", "sadness", "surprise"}
    scores = vote([(na, za), (nb, zb)], classes)
    want = score_logits(ds, classes, "single_label_classification", [scores.float()], [gold], in_domain=False)
    assert got["macro_f1"] == pytest.approx(want["macro_f1"], abs=1e-12) and got["n"] == want["n"]


def test_heads_on_one_body_share_one_pass_with_the_same_votes(heads, tmp_path, monkeypatch):
    """Per-dataset heads of one body (a merged model's) run the body once; the votes equal separate runs'."""
    from transformers import AutoModelForSequenceClassification

    import symfuse.evaluate.ensemble as ens

    body = AutoModelForSequenceClassification.from_pretrained(heads["isear"])
    merged = {}
    for n in ("isear", "meld", "crowdflower"):  # every head on isear's body
        net = AutoModelForSequenceClassification.from_pretrained(heads[n])
        net.load_state_dict({k: v for k, v in body.state_dict().items() if not k.startswith("classifier.")},
                            strict=False)  # fmt: skip
        net.save_pretrained(tmp_path / n)
        for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
            if (Path(heads[n]) / f).exists():
                (tmp_path / n / f).write_bytes((Path(heads[n]) / f).read_bytes())
        merged[n] = tmp_path / n
    assert ens.head_module(body, AutoModelForSequenceClassification.from_pretrained(merged["meld"])) == "classifier"
    assert ens.head_module(body, AutoModelForSequenceClassification.from_pretrained(heads["meld"])) is None
    calls = []
    real = ens.run_model
    monkeypatch.setattr(ens, "run_model", lambda *a, **k: calls.append(1) or real(*a, **k))
    kw = dict(max_examples=40, max_length=32)
    models = [merged["isear"], merged["crowdflower"], merged["meld"]]
    got = evaluate_heads(models, "goemotions_ekman", out_file=tmp_path / "v.json", **kw)
    assert len(calls) == 1 and got["heads"] == [str(m) for m in models]
    from symfuse.data import load_task_dataset

    ds = load_task_dataset("goemotions_ekman")
    how = dict(split="test", device="cpu", batch_size=64, seed=13, **kw)
    calls.clear()
    _, together, _ = ens._heads_logits(models, ds, how)
    alone = [ens._heads_logits([m], ds, how)[1][0] for m in models]
    assert len(calls) == 4  # 1 shared pass, then one each
    for a, b in zip(together, alone, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # a head on another body runs on its own: isear's merged head + meld's own model = two passes
    calls.clear()
    _, mixed, _ = ens._heads_logits([merged["isear"], heads["meld"]], ds, how)
    assert len(calls) == 2 and mixed[0].shape[1] == 7


class Stop(Exception):
    pass


def test_voting_reports_its_progress_and_stops_when_the_callback_raises(heads, tmp_path):
    """Each batch of each voter's pass reports (a Ctrl-C of the pipeline ends the task there); the values rise to 1."""
    kw = dict(max_examples=40, max_length=32, batch_size=8)  # 40 examples: 5 batches per pass, two heads
    seen = []
    evaluate_heads([heads["isear"], heads["meld"]], "goemotions_ekman", out_file=tmp_path / "v.json",
                   on_progress=seen.append, **kw)  # fmt: skip
    assert len(seen) == 10 and seen == sorted(seen) and seen[-1] == pytest.approx(1.0) and seen[0] > 0, seen

    def stop(fraction):
        raise Stop

    with pytest.raises(Stop):
        evaluate_heads([heads["isear"], heads["meld"]], "goemotions_ekman", out_file=tmp_path / "w.json",
                       on_progress=stop, **kw)  # fmt: skip
    assert not (tmp_path / "w.json").exists()


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
