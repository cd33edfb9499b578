"""The certified sparse assignment returns scipy's exact optimum (compiled and torch kernels alike), re-solves
when the certificate fails, and hands back to the dense solver when it cannot certify. The kernels themselves
are held to their torch versions in tests/symfuse/test_native.py."""

import numpy as np
import pytest
import torch
from scipy.optimize import linear_sum_assignment

from symfuse import native
from symfuse.match import assignment, closed_form
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


@pytest.fixture
def kernels(request, monkeypatch):
    """``(dtype, compiled)``: the torch versions of symfuse.native's kernels unless ``compiled``."""
    dtype, compiled = request.param
    if not compiled:
        monkeypatch.setattr(native, "LIB", None)
    return dtype


@pytest.mark.parametrize("kernels", KERNELS, indirect=True)
@pytest.mark.parametrize("seed", range(4))
def test_equals_scipy_on_random_problems(seed, kernels):
    cost = _cost(300, seed, kernels, hubs=seed % 2 == 0)
    before = cost.clone()
    x = certified_sparse_assignment(cost, k=8)
    assert x is not None
    assert torch.equal(x, _scipy(cost))
    assert torch.equal(cost, before)  # not modified


@pytest.mark.parametrize("kernels", KERNELS, indirect=True)
def test_violations_join_the_candidates_and_the_optimum_is_still_found(kernels, monkeypatch):
    cost = _cost(50, 0, kernels, hubs=False)
    found = []
    violations = native.violations

    def counting(*args, **kw):
        out = violations(*args, **kw)
        found.append(out[1])
        return out

    monkeypatch.setattr(native, "violations", counting)
    x = certified_sparse_assignment(cost, k=2, max_rounds=50)
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
    x = certified_sparse_assignment(cost, k=2, max_rounds=50)
    assert len(calls) > 1 and calls[-1] > calls[0]  # re-solved with the violating entries added
    assert x is not None and torch.equal(x, _scipy(cost))
    # with a single round the same problem is not certified: None, never a wrong answer
    assert certified_sparse_assignment(cost, k=2, max_rounds=1) is None


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


@pytest.mark.parametrize("kernels", KERNELS, indirect=True)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_cost_is_not_certified(bad, kernels):
    cost = _cost(60, 1, kernels)
    cost[7, 3] = bad
    assert certified_sparse_assignment(cost, k=8) is None  # the dense solver then reports it
