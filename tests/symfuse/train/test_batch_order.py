"""Length-bucketed, seeded batch order of fine-tuning; frozen parameters get no optimizer work."""

import random

import torch

from symfuse.data import load_task_dataset, load_tokenizer
from symfuse.data.batches import epoch_steps
from symfuse.train import FinetuneConfig, train_model
from symfuse.train.finetune import _build_model
from tests.symfuse.train.helpers import save_tiny_base


def _features(n=203, seed=0):
    g = random.Random(seed)
    return [{"input_ids": [1] * g.randint(3, 60)} for _ in range(n)]


def _padded_tokens(feats, steps, batch):
    total = 0
    for step in steps:
        for i in range(0, len(step), batch):
            micro = step[i : i + batch]
            total += len(micro) * max(len(feats[j]["input_ids"]) for j in micro)
    return total


def test_bucketed_steps_cover_every_example_once_are_seeded_and_pad_less():
    feats = _features()
    steps = epoch_steps(feats, 16, random.Random(7), length_buckets=4)
    assert len(steps) == -(-len(feats) // 16)  # ceil: as many optimizer steps as the plain order
    assert sorted(i for s in steps for i in s) == list(range(len(feats)))
    assert sum(len(s) != 16 for s in steps) == 1  # one short step: the epoch's remainder
    assert steps == epoch_steps(feats, 16, random.Random(7), length_buckets=4)
    assert steps != epoch_steps(feats, 16, random.Random(8), length_buckets=4)
    plain = epoch_steps(feats, 16, random.Random(7), length_buckets=None)
    assert _padded_tokens(feats, steps, 8) < 0.8 * _padded_tokens(feats, plain, 8)
    for s in steps:  # each step's examples come from one length-sorted chunk of 4 * 16 shuffled examples
        lengths = [len(feats[i]["input_ids"]) for i in s]
        assert lengths == sorted(lengths)


def test_plain_order_is_the_seeded_shuffle_cut_into_steps():
    feats = _features(50)
    order = list(range(50))
    random.Random(3).shuffle(order)
    expected = [order[i : i + 16] for i in range(0, 50, 16)]
    assert epoch_steps(feats, 16, random.Random(3), length_buckets=None) == expected


def test_frozen_parameters_stay_unchanged_and_get_no_gradient(tmp_path):
    base = save_tiny_base(tmp_path / "base")
    ds = load_task_dataset("dair_emotion", max_train_examples=32)
    cfg = FinetuneConfig(epochs=1, lr=1e-3, max_length=32, max_eval_examples=8, progress=False)
    model = _build_model(base, ds, cfg)
    for p in model.bert.embeddings.parameters():
        p.requires_grad_(False)
    trained, _ = train_model(model, ds, load_tokenizer(base), cfg)
    before, after = model.state_dict(), trained.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before if k.startswith("bert.embeddings."))
    assert not torch.equal(before["classifier.weight"], after["classifier.weight"])
    assert all(p.grad is None for n, p in trained.named_parameters() if n.startswith("bert.embeddings."))
