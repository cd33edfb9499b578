"""Fast paths equal the plain computations they replace: streamed attention statistics, batched Procrustes,
chunked sketch distances, the one-reduction finiteness check."""

import numpy as np
import pytest
import torch

from symfuse import native
from symfuse.arch import get_spec
from symfuse.errors import CheckpointError
from symfuse.match.checkpoints import check_finite
from symfuse.match.closed_form import procrustes, torch_threads
from symfuse.match.sketch import _row_sqdist
from symfuse.match.weights import _cross, attention_blocks, side_stats
from symfuse.symmetry import random_module_transform
from tests.tiny import FAMILIES, tiny_model


def _attention_modules(family):
    model = tiny_model(family, seed=2)
    sd = model.state_dict()
    spec = get_spec(model.config)
    prefix = spec.detect_prefix(sd)
    geo = spec.geometry(model.config)
    for ref in spec.modules(model.config):
        if ref.kind == "attn":
            yield ref, geo.of(ref.stack), spec.read_module(sd.__getitem__, sd.__contains__, ref, model.config, prefix)


@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_side_stats_equal_the_stacked_blocks(family):
    g = torch.Generator().manual_seed(0)
    for ref, geo, anc in _attention_modules(family):
        src = random_module_transform(ref, geo, g).apply(anc)
        sb, ab = attention_blocks(src, geo), attention_blocks(anc, geo)
        for side in ("q", "k", "v", "o"):
            for chunk in (1, 1 << 21):  # one group per chunk, and everything at once
                cross, norms = side_stats(src, anc, side, geo, chunk=chunk)
                torch.testing.assert_close(cross, _cross(sb[side], ab[side], False), atol=1e-12, rtol=1e-12)
                torch.testing.assert_close(norms, (sb[side] ** 2).sum(-1), atol=1e-12, rtol=1e-12)


def test_batched_procrustes_equals_per_head_svd():
    g = torch.Generator().manual_seed(1)
    m = torch.randn(12, 64, 64, generator=g, dtype=torch.float64)
    got = procrustes(m)
    for h in range(m.shape[0]):
        u, _, vh = np.linalg.svd(m[h].numpy())
        np.testing.assert_allclose(got[h].numpy(), u @ vh, atol=1e-10, rtol=0)
    # float32 input is promoted: the SVD runs in float64
    assert procrustes(m.float()).dtype == torch.float64


def test_torch_threads_restores_the_count():
    before = torch.get_num_threads()
    with torch_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_row_sqdist_equals_the_direct_sum(dtype, compiled, monkeypatch):
    if not compiled:  # float32 down columns go to the compiled kernel when it is built: check the torch path too
        monkeypatch.setattr(native, "LIB", None)
    g = torch.Generator().manual_seed(2)
    n, d = 50, 7
    src = {
        "up": torch.randn(n, d, generator=g).to(dtype),
        "up_bias": torch.randn(n, generator=g).to(dtype),
        "down": torch.randn(d, n, generator=g).to(dtype),
    }
    anc = {k: torch.randn(v.shape, generator=g).to(dtype) for k, v in src.items()}
    cols = torch.randperm(n, generator=g)
    want = (
        ((src["up"].double() - anc["up"][cols].double()) ** 2).sum(1)
        + (src["up_bias"].double() - anc["up_bias"][cols].double()) ** 2
        + ((src["down"].double() - anc["down"][:, cols].double()) ** 2).sum(0)
    )
    for chunk in (1, 13, 1 << 21):
        torch.testing.assert_close(_row_sqdist(src, anc, cols, chunk=chunk), want, rtol=1e-6, atol=1e-6)
    # a block of neurons, as the sketch passes them: views (down's columns lo:hi are strided)
    lo, hi = 11, 37
    part = {k: (v[:, lo:hi] if k == "down" else v[lo:hi]) for k, v in src.items()}
    torch.testing.assert_close(_row_sqdist(part, anc, cols[lo:hi]), want[lo:hi], rtol=1e-6, atol=1e-6)


def test_check_finite_one_reduction_and_fallback():
    w = {"up": torch.ones(4, 3), "perm": torch.arange(3)}
    check_finite(w, "ckpt: L00.ffn")  # finite: passes
    big = {"up": torch.full((4, 3), 3e38)}  # finite but the sum overflows: element check clears it
    check_finite(big, "ckpt: L00.ffn")
    for bad in (float("nan"), float("inf"), -float("inf")):
        t = torch.ones(4, 3, dtype=torch.bfloat16)
        t[1, 2] = bad
        with pytest.raises(CheckpointError, match=r"ckpt: L00\.ffn up holds NaN or inf"):
            check_finite({"up": t}, "ckpt: L00.ffn")


@pytest.mark.parametrize("chunk", [1, 7, 1 << 21])
def test_chunked_exact_rows_equal_the_full_argmin(chunk):
    from symfuse.match.sketch import _exact_rows
    from symfuse.match.weights import ffn_similarity

    g = torch.Generator().manual_seed(3)
    n, d = 40, 6
    src = {
        "up": torch.randn(n, d, generator=g),
        "gate": torch.randn(n, d, generator=g),
        "up_bias": torch.randn(n, generator=g),
        "down": torch.randn(d, n, generator=g),
    }
    anc = {k: v + 0.3 * torch.randn(v.shape, generator=g) for k, v in src.items()}
    rows = torch.tensor([0, 5, 17, 39])
    want = ffn_similarity(src, anc).double().argmax(1)[rows]  # -½||s_i - a_j||²: nearest = row argmax
    assert torch.equal(_exact_rows(src, anc, rows, chunk=chunk), want)


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pread_source_reads_the_stored_tensors(tmp_path, family, dtype):
    from symfuse.checkpoint import CheckpointReader
    from symfuse.match.reading import PreadSource

    folder = tmp_path / family
    tiny_model(family, seed=4).to(dtype).save_pretrained(folder)
    with CheckpointReader(folder) as reader, PreadSource(reader) as source:
        for name in reader.names():
            t = source.get(name)
            ref = reader.get(name)
            assert t.dtype == ref.dtype and t.shape == ref.shape and torch.equal(t, ref)
        for mod in reader.modules():
            got, want = source.read_module(mod), reader.read_module(mod)
            assert got.keys() == want.keys() and all(torch.equal(got[r], want[r]) for r in want)
        with pytest.raises(CheckpointError, match="not found"):
            source.get("no.such.tensor")


def test_pread_rows_and_distance_in_row_blocks(tmp_path):

    from symfuse.checkpoint import CheckpointReader
    from symfuse.match.checkpoints import _sq_distance_to
    from symfuse.match.reading import PreadSource

    folder = tmp_path / "m"
    tiny_model("bert", seed=5).save_pretrained(folder)
    g = torch.Generator().manual_seed(5)
    with CheckpointReader(folder) as reader, PreadSource(reader) as source:
        name = next(n for n in reader.names() if reader.get(n).dim() == 2)
        full = reader.get(name)
        assert torch.equal(source.get_rows(name, 3, 9), full[3:9])
        assert source.get_rows(name, 5, 5).shape == (0, full.shape[1])
        assert source.meta(name) == (full.dtype, list(full.shape))
        other = full + torch.randn(full.shape, generator=g)
        want = float(((other.double() - full.double()) ** 2).sum())
        for chunk in (1, 50, 1 << 22):
            assert abs(_sq_distance_to(other, source, name, chunk=chunk) - want) <= 1e-9 * want
        assert _sq_distance_to(other[:-1], source, name) is None  # shape mismatch
