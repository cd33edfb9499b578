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
import ctypes.util
import functools
import json
import math
import os
import struct
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from symfuse.arch import ModuleRef, ModuleWeights
from symfuse.checkpoint import WEIGHTS, WEIGHTS_INDEX, CheckpointReader
from symfuse.errors import CheckpointError

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def _header(file: Path) -> tuple[int, dict]:
    """(data start offset, header dict) of a safetensors file."""
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{file}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", raw)
        return 8 + n, json.loads(f.read(n))


class PreadSource:
    """Tensors of a checkpoint read with ``preadv`` into private memory (see the module docstring).

    Args:
        reader: The open checkpoint (gives folder, spec, config and prefix).
    """

    def __init__(self, reader: CheckpointReader):
        self.reader = reader
        index = reader.path / WEIGHTS_INDEX
        if index.exists():
            self._file_of = {k: reader.path / v for k, v in json.loads(index.read_text())["weight_map"].items()}
        else:
            single = reader.path / WEIGHTS
            self._file_of = dict.fromkeys(_header(single)[1], single)
            self._file_of.pop("__metadata__", None)
        self._headers: dict[Path, tuple[int, dict]] = {}
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()

    def _open(self, file: Path) -> tuple[int, int, dict]:
        with self._lock:
            if file not in self._fds:
                self._headers[file] = _header(file)
                self._fds[file] = os.open(file, os.O_RDONLY)
            start, header = self._headers[file]
            return self._fds[file], start, header

    def has(self, name: str) -> bool:
        """Whether the checkpoint stores ``name``."""
        return name in self._file_of

    def _info(self, name: str) -> tuple[Path, int, int, torch.dtype, list[int]]:
        """(file, fd, absolute data offset, dtype, shape) of a stored tensor."""
        file = self._file_of.get(name)
        if file is None:
            raise CheckpointError(f"{self.reader.path}: tensor {name!r} not found")
        fd, start, header = self._open(file)
        info = header.get(name)
        if info is None:
            raise CheckpointError(f"{file}: tensor {name!r} missing from the safetensors header")
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise CheckpointError(f"{file}: tensor {name!r} has unsupported dtype {info['dtype']}")
        return file, fd, start + info["data_offsets"][0], dtype, list(info["shape"])

    @staticmethod
    def _pread(file: Path, fd: int, offset: int, nbytes: int, name: str) -> torch.Tensor:
        buf = empty_hugepages((nbytes,), torch.uint8)
        view, done = memoryview(buf.numpy()), 0
        while done < nbytes:
            got = os.preadv(fd, [view[done:]], offset + done)
            if got <= 0:
                raise CheckpointError(f"{file}: truncated while reading tensor {name!r}")
            done += got
        return buf

    def get(self, name: str) -> torch.Tensor:
        """A new tensor holding the stored bytes of ``name`` (no mapping is kept).

        Raises:
            CheckpointError: absent tensor, unknown dtype or a truncated file.
        """
        file, fd, offset, dtype, shape = self._info(name)
        nbytes = math.prod(shape) * dtype.itemsize
        return self._pread(file, fd, offset, nbytes, name).view(dtype).reshape(shape)

    def get_rows(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Rows ``lo:hi`` (first axis) of a stored tensor, reading only their bytes."""
        file, fd, offset, dtype, shape = self._info(name)
        if not shape:
            return self.get(name)
        lo, hi = max(0, lo), min(shape[0], hi)
        row = math.prod(shape[1:]) * dtype.itemsize
        buf = self._pread(file, fd, offset + lo * row, max(0, hi - lo) * row, name)
        return buf.view(dtype).reshape([max(0, hi - lo), *shape[1:]])

    def meta(self, name: str) -> tuple[torch.dtype, list[int]]:
        """Stored dtype and shape of a tensor."""
        _, _, _, dtype, shape = self._info(name)
        return dtype, shape

    def read_module(self, ref: ModuleRef) -> ModuleWeights:
        """One module's canonical weights (see :meth:`CheckpointReader.read_module`; no finiteness check)."""
        r = self.reader
        return r.spec.read_module(self.get, self.has, ref, r.config, r.prefix)

    def close(self) -> None:
        """Close the file descriptors."""
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __enter__(self) -> PreadSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:  # no C library found
        return None


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    return getattr(_libc(), "malloc_trim", None)  # glibc only


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    fn = getattr(_libc(), "madvise", None)
    if fn is not None:
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
    return fn


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
