"""RegMean's one-pass Gram systems: same algebra, one build per input, files named on NaN."""

import threading

import pytest
import torch

from symfuse.checkpoint import CheckpointReader
from symfuse.errors import NonFiniteError
from symfuse.io import BufferPool, check_finite_tensor
from symfuse.merge import gram_systems as gs
from symfuse.merge import merge_checkpoints, regmean_solve
from symfuse.merge.base import LazyTensors
from symfuse.merge.regmean import RegMeanMerger, TensorInputs, gram_system
from symfuse.stats import StatsFile, linear_modules, save_stats
from tests.tiny import save_tiny, tiny_model


def _grams(k, n, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(k):
        x = torch.randn(3 * n, n, generator=g, dtype=torch.float64) * torch.logspace(0, -1, n, dtype=torch.float64)
        out.append((x.T @ x / (3 * n)).to(dtype))
    return out


def _scaled(g, alpha):
    return alpha * g + (1 - alpha) * torch.diag(torch.diagonal(g))


@pytest.mark.parametrize("alpha", [0.9, 1.0, 0.0])
@pytest.mark.parametrize("weights", [[1.0, 1.0, 1.0], [0.2, 0.5, 0.3], [0.4, 0.0, 0.6]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_one_pass_system_is_the_closed_form(alpha, weights, dtype):
    grams = _grams(3, 12)
    got = gs.build_system(grams, weights, alpha, dtype)
    ref = max(range(3), key=weights.__getitem__)
    s = sum(c * _scaled(g, alpha) for c, g in zip(weights, grams, strict=True))
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    factor = got.factor.tril().double()
    torch.testing.assert_close(factor @ factor.T, s, rtol=tol, atol=tol)
    assert got.ref == ref
    for i, (d, c) in enumerate(zip(got.diffs, weights, strict=True)):
        if i == ref or c == 0.0:
            assert d is None
        else:  # G_i' - G_r' from the stored values, rounded once
            torch.testing.assert_close(d.double(), _scaled(grams[i] - grams[ref], alpha), rtol=tol, atol=1e-7)
    old = gram_system(grams, weights, alpha, dtype)
    assert got.cond == pytest.approx(old.cond, rel=1e-5)


def test_one_pass_system_names_the_file_with_nan(tmp_path):
    grams = _grams(3, 8)
    grams[2][3, 1] = float("nan")
    checks = [lambda t, i=i: check_finite_tensor(t, "layer.x", tmp_path / f"s{i}") for i in range(3)]
    lazy = LazyTensors([lambda p, s, g=g: g.clone() for g in grams], None, "gram", checks=checks)
    with pytest.raises(NonFiniteError, match=r"s2: tensor 'layer.x' holds 1 NaN"):
        gs.build_system(lazy, [1.0, 1.0, 1.0], 0.9, torch.float32)
    with pytest.raises(NonFiniteError, match=r"s2: tensor 'layer.x'"):  # a model of weight 0 too
        gs.build_system(lazy, [1.0, 1.0, 0.0], 0.9, torch.float32)
    with pytest.raises(NonFiniteError, match="overflows"):  # finite float64 Grams whose sum is not a float32
        gs.build_system([g * 1e300 for g in _grams(2, 4)], None, 0.9, torch.float32)


def _span_inputs(files, key):
    """The Grams of ``key`` in statistics files, as the merge reads them (spans and whole loads)."""
    from symfuse.merge.checkpoints import _gram_inputs

    return _gram_inputs([StatsFile(f) for f in files], key, BufferPool())


@pytest.mark.parametrize("stored", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunk", [7, 13, 10_000])
def test_grams_read_in_spans_give_the_system_of_grams_read_whole(tmp_path, monkeypatch, stored, chunk):
    """Chunks read from the file into a per-thread buffer (diagonals across chunk borders included) build exactly
    the system of Grams read whole: same values bit for bit, and the factor of the closed form."""
    from symfuse.merge import base

    n, weights = 11, [0.3, 0.5, 0.2]
    grams = _grams(3, n, dtype=stored)
    files = [save_stats({"m": g}, tmp_path / f"g{i}.safetensors", {"kind": "gram"}) for i, g in enumerate(grams)]
    monkeypatch.setattr(base, "SERIAL_CHUNK", chunk)
    monkeypatch.setattr(base, "_CHUNK_BUFFERS", threading.local())
    reads = []
    lazy = _span_inputs(files, "m")
    real = [lazy.span(i) for i in range(3)]
    lazy._spans = [(sh, dt, lambda o, f, r=r: reads.append((o.numel(), f)) or r(o, f)) for sh, dt, r in real]
    prev = torch.get_num_threads()
    torch.set_num_threads(2)  # two threads share the chunks
    try:
        got = gs.build_system(lazy, weights, 0.9, torch.float64)
    finally:
        torch.set_num_threads(prev)
    whole = gs.build_system([g.clone() for g in grams], weights, 0.9, torch.float64)
    assert torch.equal(got.summed, whole.summed)
    assert all(a is b is None or torch.equal(a, b) for a, b in zip(got.diffs, whole.diffs, strict=True))
    # all three Grams (the reference too) were read in spans covering each element once
    assert sorted(f for _, f in reads) == sorted(list(range(0, n * n, chunk)) * 3)
    assert sum(k for k, _ in reads) == 3 * n * n


def test_a_nan_in_a_gram_read_in_spans_names_its_file(tmp_path):
    grams = _grams(3, 6)
    grams[1][2, 4] = float("nan")
    files = [save_stats({"m": g}, tmp_path / f"s{i}.safetensors", {"kind": "gram"}) for i, g in enumerate(grams)]
    with pytest.raises(NonFiniteError, match=r"s1\.safetensors: tensor 'm' holds 1 NaN"):
        gs.build_system(_span_inputs(files, "m"), [1.0, 1.0, 2.0], 0.9, torch.float64)


def test_statistics_read_span_reads_exactly_the_elements_asked(tmp_path):
    g = torch.arange(30, dtype=torch.float64).reshape(5, 6)
    f = StatsFile(save_stats({"m": g}, tmp_path / "g.safetensors", {"kind": "gram"}))
    out = torch.empty(7, dtype=torch.float64)
    assert torch.equal(f.read_span("m", out, 20), torch.arange(20, 27, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"g\.safetensors: 'm' has no torch.float64 elements 25:32"):
        f.read_span("m", out, 25)
    with pytest.raises(ValueError, match=r"torch\.float32 elements"):
        f.read_span("m", torch.empty(3), 0)


def test_merger_builds_one_system_per_input_and_merges_as_the_closed_form(monkeypatch):
    g = torch.Generator().manual_seed(3)
    keys = ["a", "a", "b", "c", "c", "d"]
    grams = {k: _grams(3, 10 + i, seed=i) for i, k in enumerate(dict.fromkeys(keys))}  # sizes differ: pools reused
    ws = [[torch.randn(7, grams[k][0].shape[0], generator=g) for _ in range(3)] for k in keys]
    built = []
    build = gs.build_system

    def spy(grams_, *a, **k):
        built.append(grams_[0].shape[0])
        return build(grams_, *a, **k)

    monkeypatch.setattr(gs, "build_system", spy)
    merger = RegMeanMerger(alpha=0.8, dtype="float64")
    merger.pool = BufferPool()
    w3 = merger.model_weights(3)
    try:
        for i, k in enumerate(keys):
            got = merger.merge_tensor(TensorInputs(str(i), ws[i], w3, gram=grams[k], gram_key=k))
            want, _ = regmean_solve(ws[i], grams[k], w3, alpha=0.8)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    finally:
        merger.close()
    assert built == [10, 11, 12, 13]  # one build per distinct input; q / k / v style repeats reuse the factor
    assert merger.counters["factor_reused"] == 2


@pytest.mark.parametrize("n", [5, 300_007])
def test_parallel_chunks_cover_every_element_once(n):
    """Every element once; each thread of the pass runs its ops with one torch thread; counts restored after."""
    from symfuse.merge import base
    from symfuse.merge.base import chunked

    x = torch.zeros(n)
    seen = []
    threads_inside = set()

    def fn(c):
        seen.append(threading.current_thread().name)
        threads_inside.add(torch.get_num_threads())
        c.add_(1.0)

    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        chunked(fn, x, parallel=True)
        assert torch.get_num_threads() == 2  # the caller's count is back
    finally:
        torch.set_num_threads(prev)
    assert torch.equal(x, torch.ones(n))
    assert len(seen) == -(-n // base.SERIAL_CHUNK) and threads_inside == {1}


def _tiny_models_with_grams(tmp_path, stored=(torch.float64,) * 3, same_input=False):
    """Three tiny BERT classifiers and a Gram file each (model i's Grams stored in ``stored[i]``; with
    ``same_input``, k / v share q's Gram, recorded as in real files); returns ``(folders, stats, linear names)``."""
    folders, stats = [], []
    model = tiny_model("bert", head="seq")
    lins = {n: m.in_features for n, m in linear_modules(model).items()}
    for i, dt in enumerate(stored):
        folders.append(save_tiny(tmp_path / f"m{i}", "bert", seed=i, head="seq"))
        gr = {name: _grams(1, n, seed=100 * i + j, dtype=dt)[0] for j, (name, n) in enumerate(sorted(lins.items()))}
        meta = {"kind": "gram", "conv1d": []}
        if same_input:
            same = {n: n.rsplit(".", 1)[0] + ".query" for n in gr if n.endswith((".key", ".value"))}
            for n, q in same.items():
                gr[n] = gr[q].clone()
            meta["same_input"] = same
        stats.append(save_stats(gr, tmp_path / f"s{i}" / "gram.safetensors", meta))
    return folders, stats, list(lins)


def _assert_layer_by_layer_regmean(out, folders, stats, names, alpha, atol):
    """Each linear weight of the merged checkpoint ``out`` is the float64 RegMean solve of its stored Grams."""
    readers = [CheckpointReader(f) for f in folders]
    with CheckpointReader(out) as merged:
        for name in names:
            grams = [StatsFile(s).get(name).double() for s in stats]
            ws = [r.get(name + ".weight") for r in readers]
            want, _ = regmean_solve(ws, grams, alpha=alpha, dtype=torch.float64)
            torch.testing.assert_close(merged.get(name + ".weight"), want.float(), rtol=0, atol=atol)
    for r in readers:
        r.close()


def test_merged_checkpoint_equals_layer_by_layer_regmean(tmp_path):
    folders, stats, names = _tiny_models_with_grams(tmp_path, same_input=True)
    out = merge_checkpoints("regmean", folders, tmp_path / "out", stats=stats, alpha=0.7, dtype="float32")
    _assert_layer_by_layer_regmean(out, folders, stats, names, alpha=0.7, atol=2e-5)


@pytest.mark.parametrize(
    ("stored", "dtype"),
    [
        ((torch.float64,) * 3, torch.float32),
        ((torch.float32,) * 3, torch.float64),
        ((torch.float64, torch.float32, torch.float64), torch.float32),
        ((torch.float32, torch.float64, torch.float32), torch.float64),
    ],
)
def test_differences_of_close_grams_are_taken_before_rounding(stored, dtype):
    """Grams that differ by 1e-6 of their size: each difference is taken in the wider of the stored and the solve
    dtype and rounded once (rounding the Grams first would cost ~5 % of it in float32), and S is their weighted
    sum, whatever mix of float32 and float64 files."""
    n, weights, alpha = 40, [0.5, 0.3, 0.2], 0.9
    base = _grams(1, n, seed=7)[0]
    grams = [(base + 1e-6 * e).to(st) for e, st in zip(_grams(3, n, seed=8), stored, strict=True)]
    got = gs.build_system(grams, weights, alpha, dtype)
    exact = [g.double() for g in grams]  # the stored values
    for i in (1, 2):
        want = _scaled(exact[i] - exact[0], alpha)
        err = float((got.diffs[i].double() - want).abs().max() / want.abs().max())
        assert got.diffs[i].dtype == dtype and err < (1e-6 if dtype == torch.float32 else 1e-12), err
    s = sum(c * _scaled(g, alpha) for c, g in zip(weights, exact, strict=True))
    factor = got.factor.tril().double()
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    torch.testing.assert_close(factor @ factor.T, s, rtol=tol, atol=tol * float(s.abs().max()))


@pytest.mark.parametrize("stored", [torch.float32, torch.float64])
def test_large_finite_grams_whose_chunk_sums_overflow_float32_still_build(stored):
    """Entries near 1e37 are finite float32 values, their sum over a chunk is not: not mistaken for NaN / inf."""
    grams = _grams(3, 40)
    scale = 3e37 / float(max(g.abs().max() for g in grams))  # S's entries below 1e38, float32's limit 3.4e38
    grams = [(g * scale).to(stored) for g in grams]
    assert all(bool(torch.isfinite(g.float()).all()) for g in grams)
    summed = sum(g.float() for g in grams)
    assert bool(torch.isfinite(summed).all()) and not torch.isfinite(summed.sum())  # S's float32 sum overflows
    got = gs.build_system(grams, None, 0.9, torch.float32)
    assert got.factor is not None and bool(torch.isfinite(got.factor.tril()).all())
    s = sum(_scaled(g.double(), 0.9) for g in grams)
    factor = got.factor.tril().double()
    torch.testing.assert_close(factor @ factor.T, s, rtol=1e-5, atol=1e-5 * float(s.abs().max()))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_merge_reads_float32_and_float64_gram_files_together(tmp_path, dtype):
    """One model's statistics stored in float32, the others' in float64 (``--gram-dtype``): one merge, the closed
    form of the stored values, at either solve precision."""
    stored = (torch.float64, torch.float32, torch.float64)
    folders, stats, names = _tiny_models_with_grams(tmp_path, stored)
    out = merge_checkpoints("regmean", folders, tmp_path / "out", stats=stats, alpha=0.9, dtype=dtype)
    _assert_layer_by_layer_regmean(out, folders, stats, names, alpha=0.9, atol=2e-5 if dtype == "float32" else 1e-6)
