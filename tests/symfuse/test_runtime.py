"""Process-level settings: torch threads per thread, and how many matching threads a machine gets."""

from __future__ import annotations

import pytest
import torch


def test_torch_threads_sets_and_restores_the_count():
    from symfuse.runtime import torch_threads

    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    seen = {}
    try:
        with torch_threads(1):
            seen["inside"] = torch.get_num_threads()
        seen["after"] = torch.get_num_threads()
    finally:
        torch.set_num_threads(prev)
    assert seen["inside"] == 1 and seen["after"] == 2


@pytest.mark.parametrize(("cpus", "expected"), [(1, 1), (2, 2), (4, 2), (8, 4), (16, 8), (64, 8)])
def test_module_workers_take_one_thread_per_two_cpus_from_2_to_8_at_small_widths(monkeypatch, cpus, expected):
    import symfuse.runtime as rt

    monkeypatch.setattr(rt, "usable_cpus", lambda: cpus)
    assert rt.module_workers(768, 3072) == expected  # roberta-base widths
    assert rt.module_workers(1536, 8960) == min(cpus, 2)  # wider: two at most (each holds a d_ffn^2 cost matrix)
    assert rt.module_workers(4096, 11008) == 1  # 7B widths: one module at a time, whatever the machine


def test_usable_cpus_follow_the_affinity_mask():
    import os

    import symfuse.runtime as rt

    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no affinity masks on this platform")
    assert rt.usable_cpus() == len(os.sched_getaffinity(0)) <= (os.cpu_count() or 1)
