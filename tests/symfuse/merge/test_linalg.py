"""RegMean's in-place linear algebra: torch's and scipy's backends give the closed forms, in the caller's memory."""

import pytest
import torch

from symfuse.merge import linalg
from symfuse.merge.gram_systems import build_system
from symfuse.merge.regmean import RegMeanMerger, TensorInputs, regmean_apply
from symfuse.stats.io import BufferPool

BACKENDS = ["torch", "scipy"]


def _spd(n, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3 * n, n, generator=g, dtype=torch.float64)
    return (x.T @ x / (3 * n) + 0.1 * torch.eye(n, dtype=torch.float64)).to(dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cholesky_and_solve_in_place_give_the_inverse(backend, dtype):
    s = _spd(9, dtype=dtype)
    work = s.clone()
    factor = linalg.cholesky_(work, backend)
    assert factor is not None and factor.data.data_ptr() == work.data_ptr()  # factored in the given memory
    low = factor.lower.double()
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    assert torch.equal(low, low.tril())
    torch.testing.assert_close(low @ low.T, s.double(), rtol=tol, atol=tol)
    torch.testing.assert_close(factor.diagonal().double(), low.diagonal())
    b = torch.randn(4, 9, dtype=dtype)  # a right-hand side (9, 4), held transposed
    want = torch.linalg.solve(s.double(), b.T.double()).T
    got = linalg.cholesky_solve_t_(b.clone(), factor)
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    if backend == "scipy":  # solved in place, no copy
        held = b.clone()
        assert linalg.cholesky_solve_t_(held, factor) is held


@pytest.mark.parametrize("backend", BACKENDS)
def test_cholesky_of_an_indefinite_matrix_is_refused(backend):
    s = _spd(5)
    s[2, 2] = -1.0
    assert linalg.cholesky_(s, backend) is None


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("a_t", [False, True])
def test_accumulated_products_in_place(backend, a_t):
    g = torch.Generator().manual_seed(1)
    sym = _spd(6, dtype=torch.float32)
    a = torch.randn((6, 4) if a_t else (4, 6), generator=g)
    c = torch.full((4, 6), float("nan"))  # beta = 0: the contents are ignored
    ptr = c.data_ptr()
    linalg.addmm_(c, a, sym, 0.0, 2.0, backend, a_t=a_t)
    want = 2.0 * (a.T if a_t else a).double() @ sym.double()
    torch.testing.assert_close(c.double(), want, rtol=1e-5, atol=1e-5)
    linalg.addmm_(c, a, sym, 1.0, -0.5, backend, a_t=a_t)
    torch.testing.assert_close(c.double(), 1.5 * (a.T if a_t else a).double() @ sym.double(), rtol=1e-5, atol=1e-5)
    assert c.data_ptr() == ptr


@pytest.mark.parametrize("conv1d", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_regmean_on_either_backend_is_the_same_merge(conv1d, dtype):
    g = torch.Generator().manual_seed(2)
    grams = [_spd(8, seed=i) for i in range(3)]
    ws = [torch.randn((8, 5) if conv1d else (5, 8), generator=g) for _ in range(3)]
    got = {}
    for backend in BACKENDS:
        system = build_system(grams, [0.2, 0.5, 0.3], 0.9, dtype, linalg=backend)
        assert system.factor.backend == backend
        got[backend], _ = regmean_apply(system, ws, conv1d)
    # the closed form W^T = S^-1 sum_i c_i G_i' W_i^T in float64
    scaled = [0.9 * s + 0.1 * torch.diag(s.diagonal()) for s in grams]
    c = [0.2, 0.5, 0.3]
    summed = sum(ci * s for ci, s in zip(c, scaled, strict=True))
    rhs = sum(ci * s @ (w.double() if conv1d else w.double().T) for ci, s, w in zip(c, scaled, ws, strict=True))
    want = torch.linalg.solve(summed, rhs)
    want = want if conv1d else want.T
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    for backend in BACKENDS:
        torch.testing.assert_close(got[backend].double(), want.float().double(), rtol=tol, atol=tol)


def test_merger_takes_the_backend_from_its_parameters():
    g = torch.Generator().manual_seed(3)
    grams = [_spd(6, seed=i) for i in range(2)]
    ws = [torch.randn(3, 6, generator=g) for _ in range(2)]
    out = {}
    for backend in BACKENDS:
        merger = RegMeanMerger(linalg=backend, dtype="float32")
        merger.pool = BufferPool()
        out[backend] = merger.merge_tensor(TensorInputs("w", ws, merger.model_weights(2), gram=grams, gram_key="k"))
        assert merger._system.factor.backend == backend
    torch.testing.assert_close(out["torch"], out["scipy"], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="linalg"):
        RegMeanMerger(linalg="mkl")


def test_auto_takes_scipy_only_on_x86_cpus_not_made_by_intel(monkeypatch):
    monkeypatch.setattr(linalg.platform, "machine", lambda: "x86_64")
    for vendor, want in (("AuthenticAMD", "scipy"), ("GenuineIntel", "torch"), ("", "torch")):
        monkeypatch.setattr(linalg, "_cpu_vendor", lambda v=vendor: v)
        assert linalg.resolve("auto") == want
    monkeypatch.setattr(linalg.platform, "machine", lambda: "arm64")
    monkeypatch.setattr(linalg, "_cpu_vendor", lambda: "AuthenticAMD")
    assert linalg.resolve("auto") == "torch"
    assert linalg.resolve("scipy") == "scipy" and linalg.resolve("torch") == "torch"


def test_scipy_blas_threads_follow_torch_threads(monkeypatch):
    threadpoolctl = pytest.importorskip("threadpoolctl")
    monkeypatch.setattr(linalg, "_applied", [])
    prev = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            linalg.sync_threads()
            infos = threadpoolctl.ThreadpoolController().select(internal_api="openblas").info()
            scipy_libs = [i for i in infos if "scipy_openblas" in i["prefix"] and "64_" not in i["prefix"]]
            assert scipy_libs and all(i["num_threads"] == n for i in scipy_libs)
    finally:
        torch.set_num_threads(prev)
        monkeypatch.setattr(linalg, "_applied", [])
        linalg.sync_threads()
