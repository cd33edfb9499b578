"""Process-level runtime settings: torch intra-op thread counts per thread, glibc malloc's mmap threshold."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

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


@functools.cache
def libc() -> ctypes.CDLL | None:
    """The C library, with ``errno`` kept for ``ctypes.get_errno`` (None where none is found)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:  # no C library found
        return None


def libc_function(name: str, argtypes: tuple, restype: type = ctypes.c_int) -> Any:
    """The C library's function ``name`` with its signature set (None where the library lacks it)."""
    fn = getattr(libc(), name, None)
    if fn is not None:
        fn.argtypes = argtypes
        fn.restype = restype
    return fn


MAP_THRESHOLD = 1 << 20  # bytes: allocations this large get their own mapping (map_large_allocations)
_M_MMAP_THRESHOLD = -3  # glibc malloc.h


def map_large_allocations(threshold: int = MAP_THRESHOLD) -> bool:
    """Give every allocation of ``threshold`` bytes or more its own mapping, returned to the OS when freed.

    glibc raises its mmap threshold (up to 32 MiB) after big frees, so module-sized tensors then come from the
    per-thread heaps, and what each worker's heap keeps after ``del`` adds to peak RSS (the match command measured
    454-481 MiB against 450-454 for the matching alone; with a fixed 1 MiB threshold 416-424 against 414-421:
    roberta-base, 2 workers, bench/results/match_speed.md, stop 23). Process-wide and permanent (it also stops the
    threshold's adjustment, so every later big allocation is a fresh mapping), so only the ``symfuse match``
    process sets it (:func:`symfuse.cli.main`), never the library; ``MALLOC_MMAP_THRESHOLD_`` in the environment
    wins. glibc only (elsewhere nothing happens).

    Returns:
        Whether the threshold was set.
    """
    fn = getattr(libc(), "mallopt", None)
    if fn is None or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    return bool(fn(_M_MMAP_THRESHOLD, int(threshold)))
