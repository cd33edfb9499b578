"""merge_checkpoints hands fresh outputs to the checkpoint writer: the same files, never a reused buffer's bytes."""

from __future__ import annotations

import os
import time

import pytest
import torch

from symfuse.io import direct
from symfuse.merge import merge_checkpoints
from symfuse.merge.regmean import RegMeanMerger
from symfuse.stats import linear_modules, save_stats
from tests.tiny import save_tiny


def _spd(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3 * n, n, generator=g, dtype=torch.float64)
    return x.T @ x / (3 * n) + 0.1 * torch.eye(n, dtype=torch.float64)


@pytest.fixture
def inputs(tmp_path, monkeypatch):
    """Three tiny models with Grams; direct writes for anything over 4 KiB, each one late (the disk lags)."""
    from symfuse.checkpoint import load_hf_model

    if not direct.direct_writes_wanted(tmp_path):
        pytest.skip(f"no direct writes on this file system ({direct.filesystem_type(tmp_path)})")
    monkeypatch.setattr(direct, "DIRECT_MIN_BYTES", 4096)
    models = [save_tiny(tmp_path / f"m{i}", "bert", seed=i, intermediate_size=512) for i in range(3)]
    stats = []
    for i, folder in enumerate(models):
        mods = linear_modules(load_hf_model(folder))
        grams = {name: _spd(mod.in_features, 10 * i + j) for j, (name, mod) in enumerate(mods.items())}
        stats.append(save_stats(grams, tmp_path / f"s{i}" / "gram.safetensors", {"kind": "gram"}))
    import symfuse.merge.checkpoints as mc

    monkeypatch.setattr(mc, "check_stats_belong", lambda *a: None)  # hand-made statistics carry no fingerprint
    real = os.pwrite

    def slow_direct(fd, data, offset):
        if len(data) >= 4096 and offset % 4096 == 0:
            time.sleep(0.02)
        return real(fd, data, offset)

    monkeypatch.setattr(direct.os, "pwrite", slow_direct)
    return models, stats


def _bytes(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*.safetensors"))}


def test_handed_over_outputs_give_the_same_files(inputs, tmp_path, monkeypatch):
    models, stats = inputs
    assert RegMeanMerger.fresh_outputs
    handed = merge_checkpoints("regmean", models, tmp_path / "handed", stats=stats, dtype="float32")
    monkeypatch.setattr(RegMeanMerger, "fresh_outputs", False)
    copied = merge_checkpoints("regmean", models, tmp_path / "copied", stats=stats, dtype="float32")
    assert _bytes(handed) == _bytes(copied) and len(_bytes(handed)) == 1


def test_an_output_in_a_reused_buffer_is_copied_before_it_is_handed_over(inputs, tmp_path, monkeypatch):
    """A merger that (against its promise) returns the merge pool's memory: the files stay right."""
    models, stats = inputs
    monkeypatch.setattr(RegMeanMerger, "fresh_outputs", False)
    want = _bytes(merge_checkpoints("regmean", models, tmp_path / "want", stats=stats, dtype="float32"))
    plain = RegMeanMerger.merge_tensor

    def reused(self, t):
        out = plain(self, t)
        return self.pool.take("the-same-slot", out.shape, out.dtype).copy_(out)  # overwritten by the next tensor

    monkeypatch.setattr(RegMeanMerger, "fresh_outputs", True)
    monkeypatch.setattr(RegMeanMerger, "merge_tensor", reused)
    got = _bytes(merge_checkpoints("regmean", models, tmp_path / "got", stats=stats, dtype="float32"))
    assert got == want
