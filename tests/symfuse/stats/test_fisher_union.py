"""The Fisher of a union head: the training loss's likelihood, Bernoullis over the dataset's own classes only."""

from __future__ import annotations

import pytest
import torch
import transformers

from symfuse.stats import collect_fisher
from tests.tiny import random_inputs, tiny_config

UNION = ["anger", "joy", "love", "sadness", "worry"]
OWN = [3, 1]  # the dataset's classes in ITS label order: sadness (id 0), joy (id 1)


@pytest.fixture
def model():
    cfg = tiny_config("bert", num_labels=len(UNION), problem_type="multi_label_classification")
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(cfg).eval().double()


def _batches():
    out = []
    for seed, gold in ((1, [0, 1, 1, 0]), (2, [1, 0, 0])):
        b = random_inputs(transformers.BertModel(tiny_config("bert")), batch=len(gold), seq=6, seed=seed)
        out.append({**b, "labels": torch.tensor(gold)})
    return out


def test_union_fisher_is_the_own_class_bernoulli_fisher_in_closed_form(model):
    got = collect_fisher(model, _batches(), columns=OWN, progress=False).fisher
    # bias of an own class c: d/db_c of  y_c log s_c + (1 - y_c) log(1 - s_c)  is  y_c - s_c  (per example)
    with torch.no_grad():
        z = torch.cat([model(**{k: v for k, v in b.items() if k != "labels"}).logits for b in _batches()])
    gold = torch.cat([b["labels"] for b in _batches()])
    y = torch.nn.functional.one_hot(gold, len(OWN)).double()
    want = ((y - torch.sigmoid(z[:, OWN])) ** 2).mean(0)
    torch.testing.assert_close(got["classifier.bias"][OWN], want, rtol=1e-10, atol=1e-14)
    # a class the dataset lacks gets no gradient at all (its rows are merged only from the models that learned it)
    others = [i for i in range(len(UNION)) if i not in OWN]
    assert torch.count_nonzero(got["classifier.bias"][others]) == 0
    assert torch.count_nonzero(got["classifier.weight"][others]) == 0
    assert torch.count_nonzero(got["classifier.weight"][OWN]) > 0


def test_without_columns_a_multi_label_head_refuses_class_ids(model):
    with pytest.raises(ValueError, match="size"):
        collect_fisher(model, _batches(), progress=False)
