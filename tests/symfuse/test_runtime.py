"""Process-level settings: torch threads per thread."""

from __future__ import annotations

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
