"""Merger closed forms on small tensors: TIES, DARE, task arithmetic, Fisher."""

import re

import pytest
import torch
from pydantic import ValidationError

from symfuse.merge import MERGERS, TensorInputs
from symfuse.merge.task_vectors import dare_drop, ties_combine, trim_top


def test_registry_declares_stats_and_base():
    sparse = {"breadcrumbs", "breadcrumbs-ties", "della", "della-linear", "sce"}  # test_mergekit_sparse.py
    geometric = {"slerp", "nuslerp", "multislerp", "karcher", "model-stock", "nearswap", "arcee-fusion", "passthrough"}
    builtin = {"simple", "fisher", "regmean", "regmean++", "task-arithmetic", "ties", "dare"}
    assert set(MERGERS) == builtin | sparse | geometric
    assert MERGERS["regmean"].required_stats == frozenset({"gram"})
    assert MERGERS["fisher"].required_stats == frozenset({"fisher"})
    assert all(not MERGERS[n].required_stats for n in ("simple", "regmean++", "task-arithmetic", "ties", "dare"))
    assert {n for n, m in MERGERS.items() if m.needs_data} == {"regmean++"}  # its Grams: collected in the merge
    with_base = {"task-arithmetic", "ties", "dare", "model-stock"} | sparse
    assert {n for n, m in MERGERS.items() if m.needs_base} == with_base
    assert {n for n, m in MERGERS.items() if m.accepts_base} == {"nuslerp", "multislerp"}  # optional
    with pytest.raises(ValidationError):
        MERGERS["regmean"](alhpa=0.5)  # typo: unknown parameter


def test_ties_hand_computed():
    t1 = torch.tensor([3.0, -1.0, 0.5, -4.0], dtype=torch.float64)
    t2 = torch.tensor([-1.0, -2.0, 0.2, 2.0], dtype=torch.float64)
    assert torch.equal(trim_top(t1, 0.5), torch.tensor([3.0, 0.0, 0.0, -4.0], dtype=torch.float64))
    # density 0.5: t1 -> [3, 0, 0, -4], t2 -> [0, -2, 0, 2]; signs of sums: [+, -, 0, -]
    # disjoint means: [3, -2, 0, -4]
    out = ties_combine([t1, t2], [0.5, 0.5], 0.5)
    torch.testing.assert_close(out, torch.tensor([3.0, -2.0, 0.0, -4.0], dtype=torch.float64))
    base = torch.ones(4, dtype=torch.float64)
    m = MERGERS["ties"](density=0.5, lam=1.0)
    merged = m.merge_tensor(TensorInputs("x", [base + t1, base + t2], [0.5, 0.5], base=base))
    torch.testing.assert_close(merged, base + out)


def test_dare_drops_and_rescales_reproducibly():
    tau = torch.randn(1000, dtype=torch.float64)
    a = dare_drop(tau, 0.7, seed=1, name="w", index=0)
    b = dare_drop(tau, 0.7, seed=1, name="w", index=0)
    c = dare_drop(tau, 0.7, seed=1, name="w", index=1)
    assert torch.equal(a, b) and not torch.equal(a, c)
    kept = a != 0
    torch.testing.assert_close(a[kept], tau[kept] / 0.3)
    assert 0.2 < kept.double().mean() < 0.4


def test_dare_composes_with_task_arithmetic_and_ties():
    base = torch.zeros(50, dtype=torch.float64)
    xs = [torch.randn(50, dtype=torch.float64) for _ in range(3)]
    w = [1 / 3] * 3
    ta = MERGERS["dare"](drop=0.5, seed=4, combine="task-arithmetic", lam=1.0)
    out = ta.merge_tensor(TensorInputs("p", xs, w, base=base))
    expected = sum(dare_drop(x, 0.5, 4, "p", i) for i, x in enumerate(xs))
    torch.testing.assert_close(out, expected)
    ti = MERGERS["dare"](drop=0.5, seed=4, combine="ties", density=1.0)
    out = ti.merge_tensor(TensorInputs("p", xs, w, base=base))
    torch.testing.assert_close(out, ties_combine([dare_drop(x, 0.5, 4, "p", i) for i, x in enumerate(xs)], w, 1.0))


def test_task_arithmetic_and_fisher_closed_forms():
    base = torch.randn(5, 3, dtype=torch.float64)
    xs = [torch.randn(5, 3, dtype=torch.float64) for _ in range(2)]
    ta = MERGERS["task-arithmetic"](lam=0.7)
    out = ta.merge_tensor(TensorInputs("p", xs, [0.5, 0.5], base=base))
    torch.testing.assert_close(out, base + 0.7 * ((xs[0] - base) + (xs[1] - base)))
    fs = [torch.rand(5, 3, dtype=torch.float64), torch.zeros(5, 3, dtype=torch.float64)]
    fm = MERGERS["fisher"](epsilon=1e-6)
    out = fm.merge_tensor(TensorInputs("p", xs, [0.5, 0.5], fisher=fs))
    expected = (fs[0] * xs[0] + 1e-6 * xs[1]) / (fs[0] + 1e-6)
    torch.testing.assert_close(out, expected)


def test_fisher_chunked_over_large_tensors_and_pooled_inputs(monkeypatch):
    from symfuse.merge import LazyTensors, base
    from symfuse.stats.io import BufferPool

    monkeypatch.setattr(base, "SERIAL_CHUNK", 7)  # many chunks, the last one partial
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(9, 11, generator=g) for _ in range(3)]
    fs = [torch.rand(9, 11, generator=g) for _ in range(3)]
    fs[1][0, :5] = 0.0  # floored at epsilon
    w = [0.2, 0.3, 0.5]
    eps = 1e-3
    expected = sum(wi * f.clamp_min(eps) * x for wi, f, x in zip(w, fs, xs)) / sum(
        wi * f.clamp_min(eps) for wi, f in zip(w, fs)
    )
    pool = BufferPool()

    def lazy(ts, slot):  # reads into one reused buffer, as merge_checkpoints does
        return LazyTensors([lambda p, s, t=t: p.take(s, t.shape, t.dtype).copy_(t) for t in ts], pool, slot)

    fm = MERGERS["fisher"](epsilon=eps)
    fm.pool = pool
    out = fm.merge_tensor(TensorInputs("p", lazy(xs, "t"), w, fisher=lazy(fs, "f")))
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-7)
    assert fs[1][0, 0] == 0.0  # inputs untouched


@pytest.mark.parametrize("weights", [[1e308, 1e308, 5e307], [3e-320, 3e-320, 1.5e-320]])
def test_model_weights_at_the_ends_of_the_float_range_keep_their_shares(weights):
    """Weights near the float maximum summed to inf (all shares 0: an all-zero merge, exit 0); tiny ones lost digits."""
    merger = MERGERS["simple"](weights=weights)
    shares = merger.model_weights(3)
    assert shares == pytest.approx([0.4, 0.4, 0.2], rel=1e-12)
    ws = [torch.full((2, 2), v) for v in (1.0, 2.0, 3.0)]
    out = merger.merge_tensor(TensorInputs("w", ws, shares))
    torch.testing.assert_close(out, torch.full((2, 2), 0.4 + 0.8 + 0.6))


@pytest.mark.parametrize(
    ("strategy", "values", "line"),
    [
        # each changed nothing: the output was byte-identical to the run without it
        ("dare", {"density": 0.3}, "strategy dare: density is read only with combine ties (a trim after the drop; "
                                   "combine is task-arithmetic) — set combine ties, or drop density"),
        ("regmean", {"bf16_tol": 0.5}, "strategy regmean: bf16_tol is read only with delta_dtype auto (delta_dtype is "
                                       "same) — set delta_dtype auto, or drop bf16_tol"),
        # a NaN was "less than 1" (and bf16_tol took nan or -5 with exit 0)
        ("regmean", {"bf16_tol": "nan", "delta_dtype": "auto"}, "--bf16_tol: Input should be a finite number"),
        ("regmean", {"bf16_tol": -5, "delta_dtype": "auto"}, "--bf16_tol: Input should be greater than 0"),
        ("ties", {"density": float("nan")}, "--density: Input should be a finite number (got nan)"),
    ],
)  # fmt: skip
def test_a_parameter_that_would_change_nothing_or_is_not_a_number_is_refused(strategy, values, line):
    from symfuse.merge import merger_params

    with pytest.raises(ValueError, match=re.escape(line)):
        merger_params(strategy, values, label=lambda k: f"--{k}")
    combined = merger_params("dare", {"density": 0.3, "combine": "ties"})
    assert combined.density == 0.3 and merger_params("regmean", {"bf16_tol": 1e-4, "delta_dtype": "auto"}).bf16_tol
