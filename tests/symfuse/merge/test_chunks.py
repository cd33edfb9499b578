"""Fused chunked passes: K tensors read span by span from their files give what the whole tensors give, bit for bit."""

import threading

import pytest
import torch
from safetensors.torch import save_file

from symfuse.io import TensorFile
from symfuse.merge import base
from symfuse.merge.base import Chunks, LazyTensors, weighted_mean
from symfuse.merge.gram_systems import build_system
from symfuse.merge.regmean import regmean_apply


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 7 elements (spans cross rows), fresh per-thread buffers, two threads sharing the chunks."""
    monkeypatch.setattr(base, "SERIAL_CHUNK", 7)
    monkeypatch.setattr(base, "_CHUNK_BUFFERS", threading.local())
    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(prev)


def _files(tmp_path, tensors):
    """Each tensor in its own safetensors file under the name ``w`` (as K models' checkpoints hold it)."""
    out = []
    for i, t in enumerate(tensors):
        save_file({"w": t.contiguous(), "pad": torch.ones(3, dtype=torch.float64)}, str(tmp_path / f"m{i}.st"))
        out.append(TensorFile(tmp_path / f"m{i}.st"))
    return out


def _lazy(files, reads=None):
    """A LazyTensors reading ``w`` whole (loaders) or in spans, counting the spans read in ``reads``."""

    def span(tf):
        def read(o, f):
            if reads is not None:
                reads.append((tf.path.name, f, o.numel()))
            return tf.read_span("w", o, f)

        return tf.shape("w"), tf.dtype("w"), read

    return LazyTensors([lambda p, s, tf=tf: tf.get("w", p, s) for tf in files], spans=[span(tf) for tf in files])


def test_chunks_from_files_and_from_memory_are_the_same_elements(tmp_path, small_chunks):
    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(5, 6, generator=g).to(dt) for dt in (torch.float32, torch.bfloat16, torch.float64)]
    from_files = Chunks(_lazy(_files(tmp_path, ts)), None, "x", torch.float64)
    in_memory = Chunks(ts, None, "y", torch.float64)
    assert from_files.shapes == in_memory.shapes == [(5, 6)] * 3 and from_files.numel == 30
    assert from_files.stored == [torch.float32, torch.bfloat16, torch.float64]
    for s, e in ((0, 7), (7, 14), (28, 30)):
        for a, b, t in zip(from_files(s, e), in_memory(s, e), ts, strict=True):
            assert a.dtype == b.dtype == torch.float64  # converted exactly (widening)
            assert torch.equal(a, b) and torch.equal(a, t.double().view(-1)[s:e])
    assert Chunks(ts, None, "z").read(1, 3, 9).dtype == torch.bfloat16  # no dtype: as stored


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weighted_mean_in_one_fused_pass_equals_the_whole_tensor_sum(tmp_path, small_chunks, dtype):
    g = torch.Generator().manual_seed(1)
    ts = [torch.randn(9, 4, generator=g).to(dtype) for _ in range(3)]
    weights = [0.2, 0.5, 0.3]
    reads = []
    got = weighted_mean(_lazy(_files(tmp_path, ts), reads), weights)
    acc = torch.zeros(9, 4)
    for t, w in zip(ts, weights, strict=True):
        acc.add_(t, alpha=w)
    assert got.dtype == dtype and torch.equal(got, acc.to(dtype))
    assert torch.equal(got, weighted_mean(ts, weights))  # the whole-tensor path: same bits
    for name in ("m0.st", "m1.st", "m2.st"):  # each file read once, in spans covering every element once
        spans = sorted((f, k) for n, f, k in reads if n == name)
        assert [f for f, _ in spans] == list(range(0, 36, 7)) and sum(k for _, k in spans) == 36


@pytest.mark.parametrize("conv1d", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_regmean_reads_weights_in_spans_and_merges_them_bit_for_bit(tmp_path, small_chunks, conv1d, dtype):
    g = torch.Generator().manual_seed(2)
    n, out = 6, 5
    x = [torch.randn(20, n, generator=g, dtype=torch.float64) for _ in range(3)]
    grams = [a.T @ a / 20 for a in x]
    shape = (n, out) if conv1d else (out, n)
    ws = [torch.randn(shape, generator=g) for _ in range(3)]
    system = build_system(grams, [0.3, 0.3, 0.4], 0.9, dtype)
    reads = []
    got, _ = regmean_apply(system, _lazy(_files(tmp_path, ws), reads), conv1d)
    want, _ = regmean_apply(system, ws, conv1d)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert sum(k for *_, k in reads) == 3 * n * out  # every model's weight read once, in spans
    with pytest.raises(ValueError, match=r"does not match Gram \(6, 6\)"):
        regmean_apply(system, [w[:-1] if conv1d else w[:, :-1] for w in ws], conv1d)


def test_tensor_file_read_span_reads_exactly_the_elements_asked(tmp_path):
    tf = _files(tmp_path, [torch.arange(12, dtype=torch.float32).reshape(3, 4)])[0]
    assert torch.equal(tf.read_span("w", torch.empty(5), 6), torch.arange(6, 11, dtype=torch.float32))
    with pytest.raises(ValueError, match=r"m0\.st: 'w' has no torch.float32 elements 10:15"):
        tf.read_span("w", torch.empty(5), 10)
    with pytest.raises(ValueError, match="float64 elements"):
        tf.read_span("w", torch.empty(2, dtype=torch.float64), 0)
