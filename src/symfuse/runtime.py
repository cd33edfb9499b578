"""Process-level runtime settings: torch intra-op thread counts per thread, and how many threads to use."""

from __future__ import annotations

import os
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


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the platform has one, else ``os.cpu_count()``)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def module_workers(d_model: int, d_ffn: int) -> int:
    """Threads matching modules side by side: up to one per two usable CPUs (2 to 8) at small widths, fewer above.

    Each worker holds two copies of a module and a ``d_ffn x d_ffn`` cost matrix. At roberta-base widths and below
    (``d_model * d_ffn <= 4e6``), 8 workers on a 16-thread machine matched a pair 1.7-2.2x faster than 2 on its CPU
    and 1.1-1.4x on its GPU (bench/results/gpu.md); a 2-core machine keeps 2. Wider models keep 2 (memory), and at
    7B widths (``> 16e6``) modules go one at a time.
    """
    width = d_model * d_ffn
    if width > 16_000_000:
        return 1
    cpus = usable_cpus()
    return min(cpus, 2 if width > 4_000_000 else min(8, max(2, cpus // 2)))
