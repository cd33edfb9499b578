"""RegMean++ on real models: one layer is RegMean; every later layer is RegMean on Grams of the merged prefix."""

import copy

import pytest
import torch

from symfuse.errors import UnsupportedArchitecture
from symfuse.merge.regmean import regmean_solve
from symfuse.merge.sequential import layer_paths, regmean_plusplus_state
from symfuse.stats.gram import collect_gram
from tests.tiny import random_inputs, tiny_model

KW = {"llama": {"pad_token_id": 0}}


def _models(family, k=2, layers=2, same_embeddings=False):
    ms = [tiny_model(family, seed=s, head="seq", num_hidden_layers=layers, **KW.get(family, {})) for s in range(k)]
    if same_embeddings:  # then layer 0 sees the same inputs as in RegMean
        emb = {n: t for n, t in ms[0].state_dict().items() if "embed" in n}
        for m in ms[1:]:
            m.load_state_dict(emb, strict=False)
    return ms


def _batches(model, k=2):
    return [[random_inputs(model, batch=3, seq=6, seed=10 * i + j) for j in range(2)] for i in range(k)]


def _regmean(models, batches, modules, weights, alpha):
    """RegMean of the named linear modules, Grams from each model's own forward (what stored Grams hold)."""
    grams = [collect_gram(m, b, progress=False, modules=modules).grams for m, b in zip(models, batches, strict=True)]
    weight = lambda n: [m.get_submodule(n).weight.detach() for m in models]  # noqa: E731
    return {f"{n}.weight": regmean_solve(weight(n), [g[n] for g in grams], weights, alpha)[0] for n in modules}


def _linears(model, prefix):
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith(prefix + ".")]


def test_one_layer_equals_regmean():
    models = _models("bert", k=3, layers=1, same_embeddings=True)
    batches = _batches(models[0], 3)
    before = [copy.deepcopy(m.state_dict()) for m in models]
    got = regmean_plusplus_state(models, batches, [1.0, 2.0, 3.0], alpha=0.9)
    (path,) = layer_paths(models[0])
    want = _regmean(models, batches, _linears(models[0], path), [1.0, 2.0, 3.0], 0.9)
    assert len(want) == 6  # q k v o up down
    for n, w in want.items():
        torch.testing.assert_close(got[n], w, rtol=0, atol=1e-6)
    bias = f"{path}.output.dense.bias"  # no Gram: the weighted mean
    torch.testing.assert_close(got[bias], sum(c * m.state_dict()[bias] for c, m in zip([1, 2, 3], models)) / 6)
    for m, b in zip(models, before, strict=True):  # the caller's models are untouched
        assert all(torch.equal(t, m.state_dict()[n]) for n, t in b.items())


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_every_layer_is_regmean_on_the_merged_prefix(family):
    # closed form, independently of the layer-boundary cache: a FULL forward of candidate i with the merged
    # embeddings and merged layers < l gives layer l's Grams; RegMean of those is the merged layer l
    models = _models(family, k=2, layers=2)
    batches = _batches(models[0])
    got = regmean_plusplus_state(models, batches, alpha=0.8)
    paths = layer_paths(models[0])
    names = list(got)
    for layer, path in enumerate(paths):
        prefix = [n for n in names if not any(n.startswith(p + ".") for p in paths[layer:])]
        prefix = [n for n in prefix if any(n.startswith(p + ".") for p in paths) or "embed" in n]
        hybrids = []
        for m in models:
            h = copy.deepcopy(m)
            h.load_state_dict({n: got[n] for n in prefix}, strict=False)
            hybrids.append(h)
        lins = _linears(models[0], path)
        grams = [collect_gram(h, b, progress=False, modules=lins).grams for h, b in zip(hybrids, batches, strict=True)]
        for n in lins:
            want, _ = regmean_solve(
                [m.get_submodule(n).weight.detach() for m in models], [g[n] for g in grams], None, 0.8
            )
            torch.testing.assert_close(got[f"{n}.weight"], want, rtol=1e-5, atol=1e-6)
    # layer 1 is not RegMean's (its Grams come from the merged layer 0, not each candidate's own)
    lins = _linears(models[0], paths[1])
    plain = _regmean(models, batches, lins, None, 0.8)
    assert any(float((plain[n] - got[n]).norm()) > 1e-4 * float(plain[n].norm()) for n in plain)
    # the linear layers after the stack: RegMean on Grams of candidate i's own tail on the fully merged body
    tail = [n for n, m in models[0].named_modules() if isinstance(m, torch.nn.Linear) and "layers." not in n
            and ".layer." not in n]  # fmt: skip
    assert tail and any(n.startswith(("classifier", "score")) for n in tail)
    tail_names = {f"{n}.{p}" for n in tail for p in ("weight", "bias")}
    hybrids = []
    for m in models:
        h = copy.deepcopy(m)
        h.load_state_dict({n: t for n, t in got.items() if n not in tail_names}, strict=False)
        hybrids.append(h)
    grams = [collect_gram(h, b, progress=False, modules=tail).grams for h, b in zip(hybrids, batches, strict=True)]
    for n in tail:
        ws = [m.get_submodule(n).weight.detach() for m in models]
        want, _ = regmean_solve(ws, [g[n] for g in grams], None, 0.8)
        torch.testing.assert_close(got[f"{n}.weight"], want, rtol=1e-5, atol=1e-6)


def test_kept_heads_are_not_merged_and_bad_inputs_are_refused():
    models = _models("bert", k=2, layers=1)
    batches = _batches(models[0])
    got = regmean_plusplus_state(models, batches, keep={"classifier.weight", "classifier.bias"})
    assert "classifier.weight" not in got and "bert.pooler.dense.weight" in got
    with pytest.raises(ValueError, match="2 models and 1 data loaders"):
        regmean_plusplus_state(models, batches[:1])
    with pytest.raises(ValueError, match="no data batches"):
        regmean_plusplus_state(models, [batches[0], []])
    other = tiny_model("bert", seed=3, head="seq", num_hidden_layers=1, intermediate_size=40)
    with pytest.raises(ValueError, match=r"model 1: .* has shape"):
        regmean_plusplus_state([models[0], other], batches)
    albert = [tiny_model("albert", seed=s, head="seq") for s in range(2)]
    with pytest.raises(UnsupportedArchitecture, match="one stored layer several times"):
        regmean_plusplus_state(albert, _batches(albert[0]))


def test_copies_of_one_model_merge_to_that_model():
    model = tiny_model("bert", seed=4, head="seq", num_hidden_layers=2)
    batches = _batches(model, 3)  # different data per copy: different Grams, the same weights
    got = regmean_plusplus_state([model] * 3, batches, [1.0, 2.0, 1.0])
    want = {n: t for n, t in model.state_dict().items() if t.is_floating_point()}
    assert set(got) == set(want)
    for n, t in want.items():
        torch.testing.assert_close(got[n], t, rtol=1e-5, atol=1e-6, msg=n)
