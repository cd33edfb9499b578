"""Batched diagonal Fisher: one forward per batch, equal to the one-example-at-a-time loop."""

import pytest
import torch

from symfuse.stats import collect_fisher
from tests.tiny import tiny_model

LENGTHS = [9, 3, 6, 1, 5]  # uneven padding, one example a single token


def _batches(model, head, n=2, seed=0, with_labels=True, multi=False):
    g = torch.Generator().manual_seed(seed)
    pad = model.config.pad_token_id or 0
    out = []
    for _ in range(n):
        ids = torch.randint(2, model.config.vocab_size, (len(LENGTHS), max(LENGTHS)), generator=g)
        mask = torch.ones_like(ids)
        for i, n_tok in enumerate(LENGTHS):
            mask[i, n_tok:] = 0
            ids[i, n_tok:] = pad
        if head == "token":
            labels = torch.randint(0, 3, ids.shape, generator=g)
            labels[mask == 0] = -100
            labels[0, 2] = -100
        elif multi:
            labels = torch.bernoulli(torch.full((len(LENGTHS), 3), 0.5), generator=g)
        else:
            labels = torch.randint(0, 3, (len(LENGTHS),), generator=g)
        out.append({"input_ids": ids, "attention_mask": mask, **({"labels": labels} if with_labels else {})})
    return out


def _reference(model, batches, mode, seed=0):
    """Today's definition, written out: one example at a time, trailing padding trimmed."""
    from symfuse.stats.fisher import head_kind, log_likelihood, sample_labels

    gen = torch.Generator().manual_seed(seed)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    acc = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in params.items()}
    count = 0
    for b in batches:
        for i in range(b["input_ids"].shape[0]):
            n_tok = int(b["attention_mask"][i].sum())
            ex = {
                "input_ids": b["input_ids"][i : i + 1, :n_tok],
                "attention_mask": b["attention_mask"][i : i + 1, :n_tok],
            }
            lab = b.get("labels")
            lab = (
                None
                if lab is None
                else (lab[i : i + 1, :n_tok] if lab.dim() == 2 and not lab.is_floating_point() else lab[i : i + 1])
            )
            logits = model(**ex).logits
            kind = head_kind(model, logits, lab)
            valid = None
            if kind == "token":
                valid = (lab != -100) if lab is not None else ex["attention_mask"].bool()
            if mode == "sampled":
                lab = sample_labels(kind, logits, gen)
            grads = torch.autograd.grad(
                log_likelihood(kind, logits, lab, valid), list(params.values()), allow_unused=True
            )
            for n, g in zip(params, grads, strict=True):
                if g is not None:
                    acc[n] += g.double() ** 2
            count += 1
    return {n: a / count for n, a in acc.items()}


def _count_forwards(model):
    calls = []
    model.register_forward_pre_hook(lambda m, a: calls.append(1))
    return calls


def _assert_equal(got, ref, rtol):
    scale = max(float(r.abs().max()) for r in ref.values())
    for name, r in ref.items():  # atol: parameters whose exact gradient is 0 (key biases) carry rounding noise only
        torch.testing.assert_close(got[name], r, rtol=rtol, atol=rtol * 1e-6 * scale, msg=name)


@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert", "gpt2", "llama"])
@pytest.mark.parametrize("head", ["seq", "token"])
@pytest.mark.parametrize("mode", ["empirical", "sampled"])
def test_batched_fisher_equals_per_example_loop(family, head, mode):
    model = tiny_model(family, head=head).double()
    if model.config.pad_token_id is None:
        model.config.pad_token_id = 0
    batches = _batches(model, head)
    forwards = _count_forwards(model)
    got = collect_fisher(model, batches, mode=mode, seed=5, progress=False)
    assert len(forwards) == len(batches)  # one pass per batch, not per example
    assert got.n_examples == 2 * len(LENGTHS) and got.n_tokens == 2 * sum(LENGTHS)
    _assert_equal(got.fisher, _reference(model, batches, mode, seed=5), rtol=1e-6)
    assert all(p.grad is None for p in model.parameters())


def test_batched_fisher_in_float32_and_multi_label_and_unlabelled_tokens():
    model = tiny_model("bert", head="seq", problem_type="multi_label_classification")
    batches = _batches(model, "seq", multi=True)
    _assert_equal(collect_fisher(model, batches, progress=False).fisher, _reference(model, batches, "empirical"), 1e-4)
    model = tiny_model("gpt2", head="token", pad_token_id=0).double()
    batches = _batches(model, "token", with_labels=False)
    got = collect_fisher(model, batches, mode="sampled", seed=1, progress=False).fisher
    _assert_equal(got, _reference(model, batches, "sampled", seed=1), rtol=1e-6)


def test_frozen_parameters_and_fallback_for_weights_read_outside_a_call():
    model = tiny_model("bert", head="seq").double()
    for p in model.bert.embeddings.parameters():
        p.requires_grad_(False)
    batches = _batches(model, "seq")
    got = collect_fisher(model, batches, progress=False).fisher
    assert not any(n.startswith("bert.embeddings.") for n in got)
    _assert_equal(got, _reference(model, batches, "empirical"), rtol=1e-6)
    deberta = tiny_model("deberta-v2", head="seq").double()  # relative embeddings read as .weight: loop fallback
    batches = _batches(deberta, "seq", n=1)
    forwards = _count_forwards(deberta)
    got = collect_fisher(deberta, batches, mode="sampled", progress=False).fisher
    assert len(forwards) == 1 + len(LENGTHS)  # the batched try (nothing drawn or added), then the loop
    _assert_equal(got, _reference(deberta, batches, "sampled"), rtol=1e-6)


@pytest.mark.parametrize("mode", ["empirical", "sampled"])
def test_batched_fisher_of_vit_through_vmapped_conv_and_embeddings(mode, monkeypatch):
    from symfuse.stats import fisher as fisher_mod
    from tests.tiny import random_inputs

    model = tiny_model("vit", head="seq").double()
    batch = random_inputs(model, batch=4, seed=1)
    batch = {"pixel_values": batch["pixel_values"].double(), "labels": torch.tensor([0, 1, 2, 1])}
    forwards = _count_forwards(model)
    got = collect_fisher(model, [batch], mode=mode, seed=2, progress=False).fisher
    assert len(forwards) == 1
    monkeypatch.setattr(fisher_mod.Recorder, "usable", lambda self: False)  # the per-example loop
    _assert_equal(got, collect_fisher(model, [batch], mode=mode, seed=2, progress=False).fisher, rtol=1e-6)
    assert len(forwards) == 1 + 1 + 4
