"""Diagonal Fisher: closed forms on the classifier, permutation equivariance, sampling."""

import copy

import pytest
import torch
import transformers

from symfuse.stats import collect_fisher
from tests.tiny import random_inputs, tiny_config, tiny_model


def _head_inputs(model, batch, module="classifier"):
    seen = []
    mod = dict(model.named_modules())[module]
    h = mod.register_forward_hook(lambda m, a, o: seen.append((a[0].detach().double(), o.detach().double())))
    with torch.no_grad():
        model(**{k: v for k, v in batch.items() if k != "labels"})
    h.remove()
    return seen[0]


def _batch(model, seed=0, labels=None):
    b = random_inputs(model, batch=4, seq=6, seed=seed)
    b["labels"] = labels
    return b


@pytest.mark.parametrize("kind", ["single", "multi", "regression"])
def test_classifier_fisher_closed_form(kind):
    overrides = {}
    if kind == "multi":
        overrides["problem_type"] = "multi_label_classification"
    model = tiny_model("bert", head="seq", **overrides)
    if kind == "regression":  # one output, Gaussian likelihood
        torch.manual_seed(0)
        model = transformers.BertForSequenceClassification(tiny_config("bert", num_labels=1)).eval()
    g = torch.Generator().manual_seed(1)
    if kind == "single":
        labels = torch.tensor([0, 2, 1, 2])
    elif kind == "multi":
        labels = torch.bernoulli(torch.full((4, 3), 0.5), generator=g)
    else:
        labels = torch.randn(4, generator=g)
    batch = _batch(model, labels=labels)
    h, logits = _head_inputs(model, batch)  # (4, d), (4, C)
    if kind == "single":
        err = torch.nn.functional.one_hot(labels, 3).double() - logits.softmax(-1)
    elif kind == "multi":
        err = labels.double() - torch.sigmoid(logits)
    else:
        err = labels.double().view(-1, 1) - logits
    per_example = err[:, :, None] * h[:, None, :]  # (4, C, d): d log p / d W
    expected_w = (per_example**2).mean(0)
    expected_b = (err**2).mean(0)
    f = collect_fisher(model, [batch], progress=False)
    torch.testing.assert_close(f.fisher["classifier.weight"], expected_w, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(f.fisher["classifier.bias"], expected_b, rtol=1e-4, atol=1e-7)
    assert f.n_examples == 4


def test_token_classification_fisher_closed_form():
    model = tiny_model("bert", head="token")
    labels = torch.randint(0, 3, (4, 6), generator=torch.Generator().manual_seed(2))
    batch = _batch(model, labels=labels)
    labels[:, 0] = -100  # special token: ignored
    labels[batch["attention_mask"] == 0] = -100
    h, logits = _head_inputs(model, batch)  # (4, T, d), (4, T, C)
    valid = (labels != -100).double()
    err = (torch.nn.functional.one_hot(labels.clamp_min(0), 3).double() - logits.softmax(-1)) * valid[..., None]
    grad_w = torch.einsum("btc,btd->bcd", err, h)  # summed over the example's tokens
    f = collect_fisher(model, [batch], progress=False)
    torch.testing.assert_close(f.fisher["classifier.weight"], (grad_w**2).mean(0), rtol=1e-4, atol=1e-7)


def _permute_ffn(model, layer, perm):
    """A copy of a BERT model with layer's FFN hidden units permuted (same function)."""
    m = copy.deepcopy(model)
    enc = m.bert.encoder.layer[layer]
    with torch.no_grad():
        enc.intermediate.dense.weight.copy_(enc.intermediate.dense.weight[perm])
        enc.intermediate.dense.bias.copy_(enc.intermediate.dense.bias[perm])
        enc.output.dense.weight.copy_(enc.output.dense.weight[:, perm])
    return m


@pytest.mark.parametrize("mode", ["empirical", "sampled"])
def test_fisher_of_permuted_model_is_permuted_fisher(mode):
    model = tiny_model("bert", head="seq")
    perm = torch.randperm(48, generator=torch.Generator().manual_seed(0))
    pm = _permute_ffn(model, 0, perm)
    batch = _batch(model, labels=torch.tensor([0, 1, 2, 1]))
    with torch.no_grad():
        strip = {k: v for k, v in batch.items() if k != "labels"}
        torch.testing.assert_close(pm(**strip).logits, model(**strip).logits, rtol=1e-5, atol=1e-6)
    f = collect_fisher(model, [batch], mode=mode, seed=3, progress=False).fisher
    fp = collect_fisher(pm, [batch], mode=mode, seed=3, progress=False).fisher
    pre = "bert.encoder.layer.0."
    expected = dict(f)
    expected[pre + "intermediate.dense.weight"] = f[pre + "intermediate.dense.weight"][perm]
    expected[pre + "intermediate.dense.bias"] = f[pre + "intermediate.dense.bias"][perm]
    expected[pre + "output.dense.weight"] = f[pre + "output.dense.weight"][:, perm]
    assert not torch.allclose(expected[pre + "output.dense.weight"], f[pre + "output.dense.weight"])
    for name in f:
        torch.testing.assert_close(fp[name], expected[name], rtol=1e-3, atol=1e-9)


def test_sampled_fisher_is_seeded_and_uses_model_samples():
    model = tiny_model("bert", head="seq")
    batch = _batch(model, labels=None)
    a = collect_fisher(model, [batch], mode="sampled", seed=0, progress=False).fisher
    b = collect_fisher(model, [batch], mode="sampled", seed=0, progress=False).fisher
    c = collect_fisher(model, [batch], mode="sampled", seed=1, progress=False).fisher
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert any(not torch.equal(a[n], c[n]) for n in a)
    with pytest.raises(ValueError, match="gold labels"):
        collect_fisher(model, [batch], mode="empirical", progress=False)
