"""Reading module tensors into private memory with ``pread`` (no mmap): resident memory = live tensors.

:class:`symfuse.checkpoint.CheckpointReader` maps the safetensors files; every tensor of a file shares that
mapping, so the touched pages of a whole shard stay resident while any tensor from it (a LayerNorm weight waiting
in an output shard, say) is alive, and releasing one module's tensors frees nothing until the last reference
goes. Matching and writing 7B-width models module by module need the opposite: a tensor's bytes are freed when
the tensor is. :class:`PreadSource` reads exactly the requested tensors' bytes into fresh tensors (one ``preadv``
system call from the page cache, no page-fault per 4 KiB) and shares no state between calls, so threads can use
it concurrently.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable, Sequence

import torch

from symfuse.arch import ModuleRef, ModuleWeights
from symfuse.checkpoint import CheckpointReader
from symfuse.runtime import libc, libc_function


class PreadSource:
    """Tensors of a checkpoint read with ``preadv`` into private memory (see the module docstring).

    The reader's validated :class:`~symfuse.io.TensorFile` objects do the reading (no second header parse);
    buffers get transparent huge pages (:func:`empty_hugepages`).

    Args:
        reader: The open checkpoint (gives folder, spec, config, prefix and the validated weight files).
    """

    def __init__(self, reader: CheckpointReader):
        self.reader = reader

    def has(self, name: str) -> bool:
        """Whether the checkpoint stores ``name``."""
        return self.reader.has(name)

    def get(self, name: str) -> torch.Tensor:
        """A new tensor holding the stored bytes of ``name`` (no mapping is kept).

        Raises:
            CheckpointError: absent tensor or a truncated file.
        """
        return self.reader.tensor_file(name).get(name, alloc=empty_hugepages)

    def get_rows(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Rows ``lo:hi`` (first axis) of a stored tensor, reading only their bytes."""
        return self.reader.tensor_file(name).get_rows(name, lo, hi, alloc=empty_hugepages)

    def meta(self, name: str) -> tuple[torch.dtype, list[int]]:
        """Stored dtype and shape of a tensor."""
        info = self.reader.tensor_file(name).info(name)
        return info.dtype, list(info.shape)

    def read_module(self, ref: ModuleRef) -> ModuleWeights:
        """One module's canonical weights (see :meth:`CheckpointReader.read_module`; no finiteness check)."""
        r = self.reader
        return r.spec.read_module(self.get, self.has, ref, r.config, r.prefix)

    def close(self) -> None:
        """Close the file descriptors (reopened on the next read)."""
        for tf in self.reader.tensor_files.values():
            tf.close()

    def __enter__(self) -> PreadSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    return getattr(libc(), "malloc_trim", None)  # glibc only


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    return libc_function("madvise", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int))


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # Linux


def empty_hugepages(shape: Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``torch.empty(shape)``, with transparent huge pages requested for it (Linux ``madvise``).

    A fresh big tensor is zeroed by the kernel 4 KiB page fault by page fault as it is first written: ~25 ms for
    a 3072 x 3072 float32 cost matrix, ~7 ms with 2 MiB pages (and fewer TLB misses while it is read). Where the
    kernel's transparent huge pages are off (or not Linux) the request is ignored: a plain tensor.
    """
    t = torch.empty(tuple(shape), dtype=dtype)
    fn = _madvise() if sys.platform.startswith("linux") else None
    if fn is not None and t.numel() * t.element_size() >= 4 * _HUGE_PAGE:
        start = (t.data_ptr() + _HUGE_PAGE - 1) & ~(_HUGE_PAGE - 1)  # the 2 MiB-aligned interior
        end = (t.data_ptr() + t.numel() * t.element_size()) & ~(_HUGE_PAGE - 1)
        fn(start, end - start, _MADV_HUGEPAGE)  # advice only: a failure leaves normal pages
    return t


def trim_heap() -> None:
    """Hand freed heap memory back to the OS (glibc ``malloc_trim``; no-op elsewhere).

    glibc raises its mmap threshold after big frees, so later module-sized tensors come from the heap and their
    pages stay resident after ``del``: peak RSS then creeps up module by module. Trimming after each module
    keeps it flat in depth.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
