"""Process-level runtime settings: torch intra-op thread counts per thread."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` torch intra-op threads, then restore the previous count.

    The count is per calling thread (OpenMP / MKL thread-local settings), so worker threads may lower it without
    touching the main thread. Used for tiny LAPACK calls (MKL's threaded SVD of small matrices is 10-50x slower
    than the sequential one: thread start-up and barriers dominate, worse still when other processes share the
    cores) and by the merge's chunked passes, whose own threads each run single-threaded torch ops
    (:func:`symfuse.merge.base.spans`).
    """
    prev = torch.get_num_threads()
    if prev == n:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)
