"""Gram statistics: stored value == X^T X / n of the layer's real inputs, padding excluded."""

import torch
from torch import nn

from symfuse.stats import collect_gram, linear_modules, load_stats, save_stats
from tests.tiny import random_inputs, tiny_model


def _captured_inputs(model, batch, names):
    """Inputs of the named modules (full, padded) from an independent hook."""
    seen = {n: [] for n in names}
    mods = dict(model.named_modules())
    hs = [mods[n].register_forward_hook(lambda m, a, o, n=n: seen[n].append(a[0].detach())) for n in names]
    with torch.no_grad():
        model(**batch)
    for h in hs:
        h.remove()
    return seen


def _batches(model, n=3):
    out = []
    for s in range(n):
        b = random_inputs(model, batch=3, seq=6 + s, seed=s)
        if "attention_mask" in b:
            b["attention_mask"][1, 2:] = 0  # heavy padding in one row
        out.append(b)
    return out


def test_gram_equals_hand_computed_xtx_over_n_without_padding():
    model = tiny_model("bert", head="seq")
    batches = _batches(model)
    names = ["bert.encoder.layer.0.attention.self.query", "bert.encoder.layer.1.output.dense", "classifier"]
    rows = {n: [] for n in names}
    for b in batches:
        seen = _captured_inputs(model, b, names)
        mask = b["attention_mask"].bool()
        for n in names:
            x = seen[n][0].double()
            rows[n].append(x[mask] if x.dim() == 3 else x)  # token rows (padding dropped) / pooled rows
    g = collect_gram(model, batches, progress=False, matmul_dtype=torch.float64)
    fast = collect_gram(model, batches, progress=False)  # default: float32 products, float64 sums
    for n in names:
        x = torch.cat(rows[n])
        torch.testing.assert_close(g.grams[n], x.T @ x / x.shape[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(fast.grams[n], x.T @ x / x.shape[0], rtol=1e-5, atol=1e-6)
        assert fast.grams[n].dtype == torch.float64
        assert g.rows[n] == x.shape[0]
    assert g.n_tokens == sum(int(b["attention_mask"].sum()) for b in batches)
    assert g.rows["classifier"] == g.n_examples == 9
    assert set(g.grams) == set(linear_modules(model))


def test_gram_does_not_depend_on_padding():
    model = tiny_model("roberta", head="base")
    b = random_inputs(model, batch=2, seq=5, seed=3)
    padded = {
        k: torch.cat([v, torch.ones(2, 4, dtype=v.dtype) * (1 if k == "input_ids" else 0)], 1) for k, v in b.items()
    }
    g1 = collect_gram(model, [b], progress=False).grams
    g2 = collect_gram(model, [padded], progress=False).grams
    for n in g1:
        torch.testing.assert_close(g1[n], g2[n], rtol=1e-5, atol=1e-6)  # float32 forward noise only


def test_gram_gpt2_conv1d_layout_and_shapes():
    model = tiny_model("gpt2", head="base")
    b = random_inputs(model, batch=2, seq=5)
    n = "h.0.attn.c_attn"
    seen = _captured_inputs(model, b, [n])
    x = seen[n][0].double()[b["attention_mask"].bool()]
    g = collect_gram(model, [b], progress=False, matmul_dtype=torch.float64)
    torch.testing.assert_close(g.grams[n], x.T @ x / x.shape[0], rtol=1e-12, atol=1e-12)
    assert n in g.conv1d and g.grams[n].shape == (32, 32)
    assert g.grams["h.0.mlp.c_proj"].shape == (48, 48)  # Conv1D (in=d_ffn, out=d): Gram over inputs


def test_gram_leaves_model_untouched_and_roundtrips(tmp_path):
    model = tiny_model("bert", head="base")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    g = collect_gram(model, _batches(model, 1), progress=False)
    assert not any(m._forward_hooks for m in model.modules() if isinstance(m, nn.Linear))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    f = save_stats(g.grams, tmp_path / "gram.safetensors", {"kind": "gram", "n_tokens": g.n_tokens, "rows": g.rows})
    tensors, meta = load_stats(f)
    assert meta["kind"] == "gram" and meta["n_tokens"] == g.n_tokens and meta["rows"] == g.rows
    for k in g.grams:
        assert torch.equal(tensors[k], g.grams[k]) and tensors[k].dtype == torch.float64


def test_same_input_groups_are_recorded_and_exact():
    model = tiny_model("bert", head="base")
    g = collect_gram(model, _batches(model, 2), progress=False)
    pre = "encoder.layer.0.attention.self."
    assert g.same_input[pre + "key"] == pre + "query" and g.same_input[pre + "value"] == pre + "query"
    assert pre + "query" not in g.same_input
    for k, v in g.same_input.items():
        assert torch.equal(g.grams[k], g.grams[v])
    assert not any(k.endswith(("output.dense", "intermediate.dense")) for k in g.same_input)  # own inputs


def test_pooled_reads_equal_plain_reads(tmp_path):
    from symfuse.stats import StatsFile
    from symfuse.stats.io import BufferPool

    tensors = {
        "a": torch.randn(7, 5, dtype=torch.float64),
        "b": torch.arange(6, dtype=torch.int64),
        "c": torch.ones(()),
    }
    sf = StatsFile(save_stats(tensors, tmp_path / "x.safetensors", {"kind": "gram"}))
    pool = BufferPool()
    for k, t in tensors.items():
        got = sf.get(k, pool, "slot")
        assert torch.equal(got, t) and got.dtype == t.dtype and torch.equal(sf.get(k), t)
    first = sf.get("a", pool, "slot")
    ptr = first.data_ptr()
    assert sf.get("b", pool, "slot").data_ptr() == ptr  # one buffer reused: no new memory per read
    assert pool.nbytes() >= 7 * 5 * 8
