"""The certified sparse assignment returns scipy's exact optimum (compiled and torch kernels alike), re-solves
when the certificate fails, and hands back to the dense solver when it cannot certify."""

import numpy as np
import pytest
import torch
from scipy.optimize import linear_sum_assignment

from symfuse.match import assignment, closed_form, lapcore
from symfuse.match.assignment import certified_sparse_assignment
from symfuse.match.closed_form import assign_max


def _cost(n, seed, dtype=torch.float32, hubs=True):
    """Unstructured costs with row and column offsets (like the FFN problem of independent models)."""
    g = torch.Generator().manual_seed(seed)
    c = torch.rand(n, n, generator=g, dtype=torch.float64)
    if hubs:
        c = c + 3 * torch.rand(n, 1, generator=g, dtype=torch.float64) + 3 * torch.rand(1, n, generator=g)
    return c.to(dtype)


def _scipy(cost):
    rows, cols = linear_sum_assignment(cost.double().numpy())
    assert np.array_equal(rows, np.arange(cost.shape[0]))
    return torch.from_numpy(cols).long()


KERNELS = [(torch.float32, True), (torch.float32, False), (torch.float64, False)]


def test_compiled_kernels_are_built():
    # `pip install` compiles _lapcore.c (optional there, so a machine without a compiler still installs);
    # here, where a compiler exists, a silently missing build would hide the fast path from every test
    assert lapcore.LIB is not None


@pytest.mark.parametrize(("dtype", "native"), KERNELS)
@pytest.mark.parametrize("seed", range(4))
def test_equals_scipy_on_random_problems(seed, dtype, native):
    cost = _cost(300, seed, dtype, hubs=seed % 2 == 0)
    before = cost.clone()
    x = certified_sparse_assignment(cost, k=8, chunk=64, native=native)
    assert x is not None
    assert torch.equal(x, _scipy(cost))
    assert torch.equal(cost, before)  # not modified


@pytest.mark.parametrize("spread", ["even", "alternating"])
def test_compiled_candidates_are_the_reduced_top_k(spread):
    cost = _cost(200, 7)
    if spread == "alternating":  # rows 100x wider than the row before: the carried-over screen passes too few
        cost = cost * torch.tensor([1.0, 100.0]).repeat(100)[:, None]
    rows_k, cols_k, abs_max = lapcore.candidates(cost, 5)
    assert abs_max == float(cost.abs().max())
    red = cost - cost.amin(0)  # column reduction, then row reduction for the column candidates
    red2 = red - red.amin(1, keepdim=True)
    # ties (every column's minimum reduces to exactly 0) make the indices ambiguous: compare the values taken
    want_rows = torch.topk(red, 5, dim=1, largest=False).values
    want_cols = torch.topk(red2, 5, dim=0, largest=False).values.T
    assert torch.equal(red.gather(1, rows_k).sort(1).values, want_rows.sort(1).values)
    assert torch.equal(red2.T.gather(1, cols_k).sort(1).values, want_cols.sort(1).values)
    assert all(len(set(r.tolist())) == 5 for r in torch.cat([rows_k, cols_k]))  # no index taken twice


def test_compiled_potentials_and_violations_match_the_torch_kernels():
    cost = _cost(120, 3)
    keys = assignment._candidates(cost, 6, chunk=32)
    x = assignment._solve_sparse(cost, keys)
    tol = 1e-12 * float(cost.abs().max())
    v = torch.zeros(120, dtype=torch.float64)
    indptr, cols = assignment._csr(keys, 120)
    w = assignment._edge_weights(cost, keys, x)  # the torch kernels' weights, to check the fixed point
    assert lapcore.potentials(cost, indptr, cols, x, v, tol) == lapcore.SETTLED
    # a fixed point: every candidate edge x_i -> j satisfies v_j <= v_{x_i} + w (up to tol)
    src = x[keys // 120]
    assert bool((v[cols] <= v[src] + w + tol).all())
    bad, count = lapcore.violations(cost, x, v, tol, cap=10_000)
    assert count == bad.numel() and count > 0  # 6 candidates per row / column leave violations on this problem
    assert torch.equal(bad.sort().values, assignment._violations(cost, x, v, tol, chunk=32).sort().values)
    # a subset of rows: exactly the violations in those rows
    rows = torch.tensor([5, 0, 77, 119])
    sub, _ = lapcore.violations(cost, x, v, tol, cap=10_000, rows=rows)
    assert torch.equal(sub.sort().values, bad[torch.isin(bad // 120, rows)].sort().values)
    assert lapcore.violations(cost, x, v, tol, cap=10, rows=torch.empty(0, dtype=torch.long))[1] == 0
    with pytest.raises(ValueError, match="rows must lie"):
        lapcore.violations(cost, x, v, tol, cap=10, rows=torch.tensor([120]))
    # cap: at most cap written, the full count returned
    few, count2 = lapcore.violations(cost, x, v, tol, cap=1)
    assert few.numel() == 1 and count2 == count
    # a negative cycle is reported, not looped on: x = identity is not optimal for this cost (the swap saves 10),
    # and edges 0 -> 1 (row 0) and 1 -> 0 (row 1), each of weight -5, close a cycle
    two = torch.tensor([[0.0, -5.0], [-5.0, 0.0]])
    full = (torch.tensor([0, 2, 4]), torch.tensor([0, 1, 0, 1]))
    cyc = lapcore.potentials(two, *full, torch.tensor([0, 1]), torch.zeros(2, dtype=torch.float64), 0.0)
    assert cyc == lapcore.NEGATIVE_CYCLE


def test_compiled_kernels_reject_bad_input():
    with pytest.raises(ValueError, match="float32"):
        lapcore.candidates(torch.zeros(4, 4, dtype=torch.float64), 2)
    with pytest.raises(ValueError, match="square"):
        lapcore.candidates(torch.zeros(4, 5), 2)
    with pytest.raises(ValueError, match="k must be"):
        lapcore.candidates(torch.zeros(4, 4), 5)
    with pytest.raises(ValueError, match="compiled"):
        certified_sparse_assignment(torch.zeros(4, 4, dtype=torch.float64), native=True)


def test_compiled_path_adds_violations_and_still_finds_the_optimum(monkeypatch):
    cost = _cost(50, 0, torch.float32, hubs=False)
    found = []
    violations = lapcore.violations

    def counting(*args, **kw):
        out = violations(*args, **kw)
        found.append(out[1])
        return out

    monkeypatch.setattr(lapcore, "violations", counting)
    x = certified_sparse_assignment(cost, k=2, max_rounds=50, native=True)
    assert found[0] > 0 and found[-1] == 0  # violations found, then none
    assert x is not None and torch.equal(x, _scipy(cost))


def test_violations_trigger_another_round(monkeypatch):
    cost = _cost(50, 0, torch.float64, hubs=False)
    calls = []
    solve = assignment._solve_sparse

    def counting(c, keys):
        calls.append(keys.numel())
        return solve(c, keys)

    monkeypatch.setattr(assignment, "_solve_sparse", counting)
    # two candidates per row / column: a full matching exists but is rarely the dense optimum
    x = certified_sparse_assignment(cost, k=2, max_rounds=50, chunk=16)
    assert len(calls) > 1 and calls[-1] > calls[0]  # re-solved with the violating entries added
    assert x is not None and torch.equal(x, _scipy(cost))
    # with a single round the same problem is not certified: None, never a wrong answer
    assert certified_sparse_assignment(cost, k=2, max_rounds=1, chunk=16) is None


def test_no_full_matching_among_candidates_gives_none():
    # one candidate per row and per column: far too few for a full matching on a hub-structured problem
    cost = _cost(50, 0, torch.float64)
    assert certified_sparse_assignment(cost, k=1) is None


def test_assign_max_sparse_path_and_dense_fallback(monkeypatch):
    sim = -_cost(300, 5)
    want = _scipy(-sim)  # row i -> column want[i]
    perm_want = torch.empty_like(want)
    perm_want[want] = torch.arange(300)
    perm, ran = assign_max(sim.clone())
    assert ran and torch.equal(perm, perm_want)
    # no certificate: scipy's dense solver answers, same optimum
    monkeypatch.setattr(closed_form, "certified_sparse_assignment", lambda cost: None)
    perm, ran = assign_max(sim.clone())
    assert ran and torch.equal(perm, perm_want)
    # small problems go straight to the dense solver
    perm, ran = assign_max(sim.clone(), sparse_from=10_000)
    assert ran and torch.equal(perm, perm_want)


def test_grow_merges_new_entries_into_sorted_keys():
    keys = torch.tensor([3, 8, 20, 41])
    assert assignment._grow(keys, torch.empty(0, dtype=torch.long)) is keys
    assert assignment._grow(keys, torch.tensor([20, 3])) is keys  # all known already
    grown = assignment._grow(keys, torch.tensor([50, 0, 20, 9, 9]))
    assert torch.equal(grown, torch.tensor([0, 3, 8, 9, 20, 41, 50]))


@pytest.mark.parametrize(("dtype", "native"), KERNELS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_cost_is_not_certified(bad, dtype, native):
    cost = _cost(60, 1, dtype)
    cost[7, 3] = bad
    assert certified_sparse_assignment(cost, k=8, native=native) is None  # the dense solver then reports it
