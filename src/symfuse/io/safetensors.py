"""The one safetensors header parser, dtype table, ``pread`` reader and atomic writer of the package.

Every reader of weights and statistics goes through :func:`read_header`, which validates a file once before any
tensor is read: the 8-byte header length lies within the file, the header is a JSON object, every entry names
a known dtype, its shape times the dtype's size equals its byte span, spans lie inside the data section and do
not overlap. A bad file raises :class:`~symfuse.errors.CheckpointError` naming the file, what is wrong and the
fix, never a traceback from deep inside a command.

:class:`TensorFile` reads tensors with ``os.preadv`` into private memory (no mmap: resident memory = live
tensors; several threads may read one file), optionally into a reusable :class:`BufferPool` slot or a buffer
from any allocator (the matcher asks for transparent huge pages). :func:`save_safetensors` writes atomically
(temporary file + fsync + rename).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import itertools
import json
import math
import os
import struct
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from symfuse.errors import CheckpointError
from symfuse.io.modes import not_readable, plain_mode

DTYPES: dict[str, torch.dtype] = {
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
_ITEMSIZE = {k: torch.empty((), dtype=v).element_size() for k, v in DTYPES.items()}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors format's own limit
_FIX = "re-download or re-export the file (save_pretrained with safe_serialization)"


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives in a safetensors file (offsets are absolute file positions)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        """Bytes of the stored tensor."""
        return self.end - self.begin


@dataclass(frozen=True)
class Header:
    """A validated safetensors header: tensors by name and the free-form string metadata."""

    path: Path
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]


def _bad(file: Path, what: str) -> CheckpointError:
    return CheckpointError(f"{file}: {what} — {_FIX}")


def read_header(file: str | os.PathLike) -> Header:
    """Parse and validate a safetensors header (reads only the header bytes).

    Args:
        file: A ``.safetensors`` file.

    Returns:
        The validated header.

    Raises:
        CheckpointError: missing, unreadable (permissions), empty, truncated or garbage file, or a header whose
            entries lie (unknown dtype, shape that does not match its byte span, spans outside the file or
            overlapping).
    """
    file = Path(file)
    try:
        size = file.stat().st_size
        with open(file, "rb") as fh:
            raw = fh.read(8)
            if len(raw) < 8:
                raise _bad(file, f"not a safetensors file ({size} bytes, shorter than its 8-byte header length)")
            (n,) = struct.unpack("<Q", raw)
            if n == 0 or n > MAX_HEADER_BYTES or 8 + n > size:
                raise _bad(file, f"not a safetensors file or truncated (header length {n}, file size {size})")
            blob = fh.read(n)
    except FileNotFoundError as exc:
        raise CheckpointError(f"{file}: file not found — {_FIX}") from exc
    except IsADirectoryError as exc:
        raise CheckpointError(f"{file}: is a folder, expected a safetensors file — {_FIX}") from exc
    except PermissionError as exc:
        raise not_readable(file) from exc
    try:
        header = json.loads(blob)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _bad(file, f"header is not valid JSON ({exc.__class__.__name__})") from exc
    if not isinstance(header, dict):
        raise _bad(file, "header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise _bad(file, "__metadata__ is not a JSON object")
    start = 8 + n
    tensors: dict[str, TensorInfo] = {}
    for name, info in header.items():
        tensors[name] = _entry(file, name, info, start, size)
    spans = sorted((t.begin, t.end, name) for name, t in tensors.items() if t.nbytes)
    for (_, end0, a), (begin1, _, b) in itertools.pairwise(spans):
        if begin1 < end0:
            raise _bad(file, f"tensors {a!r} and {b!r} overlap in the data section")
    return Header(file, tensors, {str(k): str(v) for k, v in meta.items()})


def _entry(file: Path, name: str, info: Any, start: int, size: int) -> TensorInfo:
    """One validated header entry."""
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise _bad(file, f"header entry {name!r} lacks dtype / shape / data_offsets")
    code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if code not in DTYPES:
        raise _bad(file, f"tensor {name!r} has unknown dtype {code!r} (known: {', '.join(DTYPES)})")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise _bad(file, f"tensor {name!r} has an invalid shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
        raise _bad(file, f"tensor {name!r} has invalid data_offsets {offsets!r}")
    begin, end = offsets
    if not 0 <= begin <= end:
        raise _bad(file, f"tensor {name!r} has data_offsets {offsets} that run backwards")
    if end - begin != math.prod(shape) * _ITEMSIZE[code]:
        raise _bad(
            file,
            f"tensor {name!r}: shape {shape} x {code} is {math.prod(shape) * _ITEMSIZE[code]} bytes "
            f"but its data_offsets span {end - begin}",
        )
    if start + end > size:
        raise _bad(file, f"tensor {name!r} ends at byte {start + end}, past the end of the file ({size} bytes)")
    return TensorInfo(DTYPES[code], tuple(shape), start + begin, start + end)


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)  # errnos of a full disk or an exhausted quota
DISK_FULL_FIX = "free disk space there (or point TMPDIR / the store elsewhere)"


def write_error(file: str | os.PathLike, code: int | None, detail: str) -> OSError:
    """The OSError for a failed write of ``file``: names the file, keeps ``code`` (errno), says the fix."""
    fix = DISK_FULL_FIX if code in DISK_FULL else "check the folder"
    return OSError(code, f"{file}: could not be written ({detail}) — {fix}")


def rows_per_block(shape: Sequence[int], elements: int) -> int:
    """How many leading-axis rows of a tensor of ``shape`` fit in a block of ``elements`` (at least one)."""
    return max(1, elements // max(1, math.prod(int(s) for s in shape[1:])))


PARALLEL_READ = 16 << 20  # bytes: larger reads are split across threads (TensorFile.read_into, parallel_reads)
_SPLIT = threading.local()


@contextlib.contextmanager
def parallel_reads() -> Iterator[None]:
    """In this block, reads of :data:`PARALLEL_READ` bytes or more by THIS thread are split across threads.

    Copying from the page cache is CPU work: on two cores a split read is 1.7x faster when nothing else runs
    (a merge's main thread). Where other threads already use every core (``symfuse match``'s workers), the extra
    readers only compete with them, so reads stay in the calling thread unless it asks.
    """
    prev = getattr(_SPLIT, "on", False)
    _SPLIT.on = True
    try:
        yield
    finally:
        _SPLIT.on = prev


@functools.cache
def _readers() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(3, thread_name_prefix="symfuse-read")


class BufferPool:
    """Reusable CPU buffers by slot name, so that streaming loops do not allocate (and page-fault) every tensor.

    Freshly allocated large tensors cost about as much CPU time in page faults as reading them from the page
    cache; a loop that reads K models' tensors one after another into the same slot touches its memory once.
    A tensor taken from a slot is valid until the slot is taken again.
    """

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}

    def take(self, slot: str, shape: tuple[int, ...] | list[int] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A tensor of ``shape`` and ``dtype`` backed by slot ``slot`` (contents undefined)."""
        numel = 1
        for n in shape:
            numel *= int(n)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        buf = self._bufs.get(slot)
        if buf is None or buf.numel() < nbytes:
            buf = self._bufs[slot] = torch.empty(max(nbytes, 64), dtype=torch.uint8)
        return buf[:nbytes].view(dtype).view(tuple(shape))

    def swap(self, a: str, b: str) -> None:
        """Exchange the buffers of two slots (tensors taken from them keep their memory)."""
        self._bufs[a], self._bufs[b] = self._bufs.pop(b, None), self._bufs.pop(a, None)  # type: ignore[assignment]
        for k in (a, b):
            if self._bufs[k] is None:
                del self._bufs[k]

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lives in one of this pool's buffers (so a later :meth:`take` may overwrite it)."""
        ptr = t.untyped_storage().data_ptr()
        return any(b.untyped_storage().data_ptr() == ptr for b in self._bufs.values())

    def nbytes(self) -> int:
        """Bytes held by every slot."""
        return sum(b.numel() for b in self._bufs.values())

    def clear(self) -> None:
        """Drop every buffer."""
        self._bufs.clear()


class TensorFile:
    """Tensors of one safetensors file read with ``os.preadv`` into private memory (see the module docstring).

    The header is validated on construction (:func:`read_header`). One read-only descriptor is opened on first
    use and shared by every thread (``preadv`` has no file position).

    Args:
        file: A ``.safetensors`` file.
        header: Its already parsed header (parsed here when None).
    """

    def __init__(self, file: str | os.PathLike, header: Header | None = None):
        self.path = Path(file)
        self.header = header if header is not None else read_header(self.path)
        self.metadata = self.header.metadata
        self._fd: int | None = None
        self._lock = threading.Lock()

    def keys(self) -> list[str]:
        """Tensor names in the file."""
        return list(self.header.tensors)

    def info(self, name: str) -> TensorInfo:
        """Dtype, shape and byte span of one tensor.

        Raises:
            CheckpointError: if the file has no such tensor.
        """
        info = self.header.tensors.get(name)
        if info is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} missing from the safetensors header — {_FIX}")
        return info

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of one tensor, without reading it."""
        return self.info(name).shape

    def dtype(self, name: str) -> torch.dtype:
        """Stored dtype of one tensor, without reading it."""
        return self.info(name).dtype

    def _fileno(self) -> int:
        with self._lock:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDONLY)
            return self._fd

    def read_into(self, out: torch.Tensor, offset: int, name: str) -> torch.Tensor:
        """Fill ``out``'s bytes from absolute file position ``offset`` (one ``preadv`` per call, usually).

        Inside :func:`parallel_reads`, a read of :data:`PARALLEL_READ` bytes or more is split into parts read by up
        to ``torch.get_num_threads()`` (at most 4) threads at once.
        """
        nbytes = out.numel() * out.element_size()
        if not nbytes:
            return out
        view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
        fd = self._fileno()
        split = nbytes >= PARALLEL_READ and getattr(_SPLIT, "on", False)
        parts = min(4, torch.get_num_threads(), nbytes // (PARALLEL_READ // 2)) if split else 1
        if parts <= 1:
            self._pread(fd, view, offset, name)
            return out
        step = -(-nbytes // parts)
        futures = [
            _readers().submit(self._pread, fd, view[lo : lo + step], offset + lo, name)
            for lo in range(step, nbytes, step)
        ]
        try:
            self._pread(fd, view[:step], offset, name)  # the calling thread reads the first part
        finally:
            for f in futures:
                f.result()
        return out

    def _pread(self, fd: int, view: memoryview, offset: int, name: str) -> None:
        done = 0
        while done < len(view):
            got = os.preadv(fd, [view[done:]], offset + done)
            if got <= 0:
                raise CheckpointError(f"{self.path}: file ends inside tensor {name!r}; it is truncated — {_FIX}")
            done += got

    def read_span(self, name: str, out: torch.Tensor, first: int) -> torch.Tensor:
        """Fill the flat ``out`` (the stored dtype) with elements ``first:first + out.numel()`` of tensor ``name``.

        Raises:
            CheckpointError: the tensor is absent.
            ValueError: ``out`` is not of the stored dtype, or the span runs past the tensor's end.
        """
        info = self.info(name)
        if out.dtype != info.dtype or first < 0 or first + out.numel() > math.prod(info.shape):
            raise ValueError(f"{self.path}: {name!r} has no {out.dtype} elements {first}:{first + out.numel()}")
        return self.read_into(out, info.begin + first * out.element_size(), name)

    def get(self, name: str, pool: BufferPool | None = None, slot: str = "") -> torch.Tensor:
        """One tensor in new memory or ``pool``'s ``slot``."""
        info = self.info(name)
        if pool is not None:
            out = pool.take(slot or "read", info.shape, info.dtype)
        else:
            out = torch.empty(info.shape, dtype=info.dtype)
        return self.read_into(out, info.begin, name)

    def get_rows(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Rows ``lo:hi`` (first axis) of a stored tensor, reading only their bytes."""
        info = self.info(name)
        if not info.shape:
            return self.get(name)
        lo, hi = max(0, lo), min(info.shape[0], hi)
        row = math.prod(info.shape[1:]) * info.dtype.itemsize
        out = torch.empty((max(0, hi - lo), *info.shape[1:]), dtype=info.dtype)
        return self.read_into(out, info.begin + lo * row, name)

    def close(self) -> None:
        """Close the descriptor (reopened on the next read)."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def __enter__(self) -> TensorFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


def fsync_dir(folder: str | os.PathLike) -> None:
    """Flush a folder's entries (a rename inside it) to disk; a no-op where folders cannot be opened."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_safetensors(
    tensors: Mapping[str, torch.Tensor], file: str | os.PathLike, metadata: Mapping[str, str] | None = None
) -> Path:
    """Write a safetensors file atomically: temporary file in the same folder, fsync, rename.

    A killed write leaves the previous file (if any) readable and no partial file under the final name.

    Args:
        tensors: Tensors by name (made contiguous).
        file: Destination.
        metadata: String metadata (``__metadata__``).

    Returns:
        The written file.
    """
    file = Path(file)
    file.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{file.name}.", suffix=".tmp", dir=file.parent)
    os.close(fd)
    try:
        try:
            save_file({k: v.detach().contiguous() for k, v in tensors.items()}, tmp, metadata=dict(metadata or {}))
        except SafetensorError as exc:  # its I/O errors name no file and carry no errno
            if "I/O error" not in str(exc):
                raise
            raise write_error(file, errno.ENOSPC if "No space left" in str(exc) else errno.EIO, str(exc)) from exc
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        plain_mode(tmp)  # mkstemp made it 0600
        os.replace(tmp, file)
        fsync_dir(file.parent)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return file
