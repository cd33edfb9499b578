"""Each compiled kernel of symfuse.native equals its plain-torch version (the oracle), which runs without the build."""

import pytest
import torch

from symfuse import native
from symfuse.match import assignment


def _cost(n, seed, dtype=torch.float32):
    """Unstructured costs with row and column offsets (like the FFN problem of independent models)."""
    g = torch.Generator().manual_seed(seed)
    c = torch.rand(n, n, generator=g, dtype=torch.float64)
    c = c + 3 * torch.rand(n, 1, generator=g, dtype=torch.float64) + 3 * torch.rand(1, n, generator=g)
    return c.to(dtype)


@pytest.fixture
def torch_only(monkeypatch):
    """Runs a call with the torch versions: ``torch_only(fn, *args)``."""

    def call(fn, *args, **kw):
        with monkeypatch.context() as m:
            m.setattr(native, "LIB", None)
            return fn(*args, **kw)

    return call


def test_compiled_kernels_are_built():
    # `pip install` compiles _lapcore.c (optional there, so a machine without a compiler still installs);
    # here, where a compiler exists, a silently missing build would hide the fast path from every test
    assert native.LIB is not None


@pytest.mark.parametrize("spread", ["even", "alternating"])
def test_candidates_are_the_reduced_top_k_either_way(spread, torch_only):
    cost = _cost(200, 7)
    if spread == "alternating":  # rows 100x wider than the row before: the kernel's carried-over screen passes few
        cost = cost * torch.tensor([1.0, 100.0]).repeat(100)[:, None]
    red = cost - cost.amin(0)  # column reduction, then row reduction for the column candidates
    red2 = red - red.amin(1, keepdim=True)
    want_rows = torch.topk(red, 5, dim=1, largest=False).values.sort(1).values
    want_cols = torch.topk(red2, 5, dim=0, largest=False).values.T.sort(1).values
    for rows_k, cols_k, abs_max in (native.candidates(cost, 5), torch_only(native.candidates, cost, 5, chunk=64)):
        assert abs_max == float(cost.abs().max())
        # ties (every column's minimum reduces to exactly 0) make the indices ambiguous: compare the values taken
        assert torch.equal(red.gather(1, rows_k).sort(1).values, want_rows)
        assert torch.equal(red2.T.gather(1, cols_k).sort(1).values, want_cols)
        assert all(len(set(r.tolist())) == 5 for r in torch.cat([rows_k, cols_k]))  # no index taken twice
    bad = cost.clone()
    bad[3, 4] = float("nan")
    assert native.candidates(bad, 5)[2] == torch_only(native.candidates, bad, 5)[2] == float("inf")


def test_potentials_and_violations_equal_the_torch_versions(torch_only):
    n = 120
    cost = _cost(n, 3)
    rows_k, cols_k, _ = native.candidates(cost, 6)
    keys = assignment._flat(rows_k, cols_k)
    x = assignment._solve_sparse(cost, keys)
    tol = 1e-12 * float(cost.abs().max())
    indptr, cols = assignment._csr(keys, n)
    v, v_torch = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    assert native.potentials(cost, indptr, cols, x, v, tol) == native.SETTLED
    assert torch_only(native.potentials, cost, indptr, cols, x, v_torch, tol) == native.SETTLED
    # fixed points: every candidate edge x_i -> j satisfies v_j <= v_{x_i} + C[i, j] - C[i, x_i] (up to tol)
    w = cost.double()[keys // n, cols] - cost.double()[keys // n, x[keys // n]]
    for pot in (v, v_torch):
        assert bool((pot[cols] <= pot[x[keys // n]] + w + tol).all())
    bad, count = native.violations(cost, x, v, tol, cap=10_000)
    assert count == bad.numel() > 0  # 6 candidates per row / column leave violations on this problem
    assert torch.equal(torch_only(native.violations, cost, x, v, tol, cap=10_000, chunk=32)[0], bad)
    # a subset of rows, in the order given: exactly the violations in those rows, row by row
    rows = torch.tensor([77, 0, 5, 119])
    sub, _ = native.violations(cost, x, v, tol, cap=10_000, rows=rows)
    want = torch.cat([bad[bad // n == r] for r in rows])
    assert torch.equal(sub, want) and torch.equal(torch_only(native.violations, cost, x, v, tol, 10_000, rows)[0], want)
    for run in (native.violations, lambda *a, **k: torch_only(native.violations, *a, **k)):
        assert run(cost, x, v, tol, cap=10, rows=torch.empty(0, dtype=torch.long))[1] == 0
        few, count2 = run(cost, x, v, tol, cap=1)  # at most cap written, the full count returned
        assert few.numel() == 1 and count2 == count
    # float64 costs take the torch version: the same entries
    assert torch.equal(native.violations(cost.double(), x, v, tol, cap=10_000)[0], bad)


def test_a_negative_cycle_or_a_spent_budget_is_reported_not_looped_on(torch_only):
    # x = identity is not optimal for this cost (the swap saves 10): edges 0 -> 1 (row 0) and 1 -> 0 (row 1),
    # each of weight -5, close a cycle
    two = torch.tensor([[0.0, -5.0], [-5.0, 0.0]])
    full = (torch.tensor([0, 2, 4]), torch.tensor([0, 1, 0, 1]))
    for run in (native.potentials, lambda *a: torch_only(native.potentials, *a)):
        d = torch.zeros(2, dtype=torch.float64)
        assert run(two, *full, torch.tensor([0, 1]), d, 0.0) == native.NEGATIVE_CYCLE
        d = torch.zeros(2, dtype=torch.float64)
        assert run(two, *full, torch.tensor([0, 1]), d, 0.0, 1) == native.OVER_BUDGET


def test_bad_input_is_refused_before_any_kernel():
    with pytest.raises(ValueError, match="square"):
        native.candidates(torch.zeros(4, 5), 2)
    with pytest.raises(ValueError, match="k must be"):
        native.candidates(torch.zeros(4, 4), 5)
    x, v = torch.arange(4), torch.zeros(4, dtype=torch.float64)
    with pytest.raises(ValueError, match="rows must lie"):
        native.violations(torch.zeros(4, 4), x, v, 0.0, cap=10, rows=torch.tensor([4]))
    with pytest.raises(ValueError, match="2 columns"):
        native.row_two_smallest(torch.zeros(3, 1))


@pytest.mark.parametrize("shape", [(64, 3072), (7, 19), (5, 2), (3, 9)])
def test_row_two_smallest_equals_topk(shape, torch_only):
    g = torch.Generator().manual_seed(3)
    for m in (torch.randn(shape, generator=g), torch.randint(0, 3, shape, generator=g).float()):  # ties too
        for best, second in (native.row_two_smallest(m), torch_only(native.row_two_smallest, m)):
            assert torch.equal(best, m.argmin(1))  # first column on ties, as argmin
            assert torch.equal(second, m.sort(1).values[:, 1])


def test_sqdist_columns_equals_the_direct_sum(torch_only):
    g = torch.Generator().manual_seed(2)
    s, a = torch.randn(7, 90, generator=g), torch.randn(7, 50, generator=g)
    part = s[:, 11:61]  # a column slice: rows strided
    cols = torch.randperm(50, generator=g)
    want = ((part.double() - a[:, cols].double()) ** 2).sum(0)
    for run in (native.sqdist_columns, lambda *x, **k: torch_only(native.sqdist_columns, *x, **k)):
        for chunk in (1, 13, 1 << 21):
            out = torch.ones(50, dtype=torch.float64)
            run(part, a, cols, out, chunk=chunk)
            torch.testing.assert_close(out, want + 1, rtol=1e-6, atol=1e-6)
