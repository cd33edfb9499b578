"""Large writes that go around the page cache (``O_DIRECT``) on local disk file systems.

A buffered ``pwrite`` into a new file makes the kernel allocate and account a page-cache page (and, on ext4, a
delayed block reservation) per 4 KiB: measured here (ext4, shared 2-core VM), 0.9-1.1 CPU seconds for 0.5 GB,
whereas the same bytes written with ``O_DIRECT`` from a reused aligned buffer take 0.01-0.04 CPU seconds and
0.14-0.19 s of wall time (bench/results/merge_speed.md, stop 23). A merged checkpoint is not read back by the
process that writes it, so caching its pages buys nothing.

:class:`DirectWriter` writes the 4 KiB-aligned middle of a large range through a second descriptor opened with
``O_DIRECT``: the bytes are copied into reused page-aligned buffers and written by a background thread while the
caller goes on (a caller that hands its memory over, promising not to change it, is not even held up by the copy);
the caller writes the unaligned ends through its ordinary descriptor (no page is ever written both ways, so the page
cache and the disk never disagree). ``fsync`` on either descriptor flushes both, after
:meth:`DirectWriter.flush`. Only on file systems known to support it on a local block device (ext4, xfs, btrfs,
f2fs): network and FUSE file systems, tmpfs, overlay and anything unknown keep buffered writes. If the kernel still
refuses a direct write (``EINVAL``), the writer switches itself off and writes the rest buffered.
``SYMFUSE_DIRECT_WRITES=0`` switches direct writes off everywhere.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
import queue
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from symfuse.io.safetensors import write_error
from symfuse.runtime import libc_function

log = logging.getLogger(__name__)

ALIGN = 4096  # file offsets, lengths and the buffer of a direct write are multiples of this
BOUNCE_BYTES = 1 << 20  # each reused aligned buffer (larger ones measured no faster)
BOUNCE_BUFFERS = 4  # buffers per file: the bytes queued for the disk at most
DIRECT_MIN_BYTES = 1 << 20  # smaller writes stay buffered (a copy and a hand-over to the writer thread per call)
HANDED_OVER_BYTES = 256 << 20  # bytes of handed-over tensors waiting for the disk at most (the caller then waits)
# statfs f_type of local block-device file systems whose O_DIRECT is known to work (linux/magic.h)
DIRECT_FILESYSTEMS = {0xEF53: "ext4", 0x58465342: "xfs", 0x9123683E: "btrfs", 0xF2F52010: "f2fs"}


@functools.cache
def _statfs() -> Any:
    if not sys.platform.startswith("linux") or not hasattr(os, "O_DIRECT"):
        return None
    return libc_function("statfs", (ctypes.c_char_p, ctypes.c_void_p))


def filesystem_type(path: str | os.PathLike) -> int | None:
    """The ``statfs`` magic number of the file system holding ``path`` (None where it cannot be asked)."""
    fn = _statfs()
    if fn is None:
        return None
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux; f_type comes first
    if fn(os.fsencode(path), buf) != 0:
        return None
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


def direct_writes_wanted(path: str | os.PathLike) -> bool:
    """Whether files at ``path`` get direct writes: allowed by the environment and on a known local file system."""
    if os.environ.get("SYMFUSE_DIRECT_WRITES", "1").strip().lower() in {"0", "false", "no", "off"}:
        return False
    return filesystem_type(path) in DIRECT_FILESYSTEMS


class DirectWriter:
    """Writes the aligned middle of large ranges of one file with ``O_DIRECT``, behind the caller's back.

    :meth:`write` copies the bytes into free page-aligned bounce buffers and returns; one background thread writes
    them to the disk (a full set of buffers in flight makes the caller wait), so the disk writes while the caller
    computes, as the page cache's writeback would. What the kernel refuses (``EINVAL``: direct writes then stop for
    this file) or writes short goes through ``fallback`` (the caller's buffered write). The first error is raised
    by the next :meth:`write` or by :meth:`flush`, which waits for every queued byte (call it before ``fsync``).

    Args:
        path: The file (already created by the caller, who keeps its own buffered descriptor).
        fallback: ``fallback(view, offset)`` writes bytes buffered (raising errors that name the file).
        enabled: False: no direct writes (:meth:`middle` is always empty).

    Attributes:
        direct_bytes: Bytes written directly so far (0 when direct writes are off).
    """

    def __init__(self, path: str | os.PathLike, fallback: Callable[[memoryview, int], None], enabled: bool = True):
        self.path = Path(path)
        self.direct_bytes = 0
        self._fallback = fallback
        self._fd = -1
        self._free: queue.SimpleQueue[memoryview] | None = None  # bounce buffers not in flight
        self._own: memoryview | None = None  # the writer thread's buffer for handed-over memory
        self._executor: ThreadPoolExecutor | None = None
        self._in_flight = 0
        self._handed_over = 0  # bytes of handed-over views not yet copied out
        self._error: BaseException | None = None
        self._lock = threading.Lock()  # one producer at a time
        self._done = threading.Condition()
        if enabled and direct_writes_wanted(self.path.parent):
            try:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_DIRECT)
            except OSError as exc:  # the file system refuses O_DIRECT after all: buffered writes, as before
                log.debug("%s: no direct writes (%s)", self.path, exc)

    @property
    def active(self) -> bool:
        """Whether direct writes are on for this file."""
        return self._fd >= 0

    def middle(self, offset: int, nbytes: int) -> tuple[int, int]:
        """The part ``[a, b)`` of ``[offset, offset + nbytes)`` this writer would take (``a == b``: none)."""
        if self._fd < 0 or nbytes < DIRECT_MIN_BYTES:
            return offset, offset
        a = -(-offset // ALIGN) * ALIGN
        b = (offset + nbytes) // ALIGN * ALIGN
        return (a, b) if b > a else (offset, offset)

    def write(self, view: memoryview, offset: int, owner: object = None) -> None:
        """Queue ``view`` (bytes ``[offset, offset + len(view))``, as returned by :meth:`middle`) for the disk.

        Without ``owner``, ``view`` may be reused as soon as this returns (its bytes are copied here). With
        ``owner`` (the object owning ``view``'s memory, kept alive until written) the memory is handed over: the
        caller must not change it until :meth:`flush` returns; the writer thread copies it out, and the caller
        waits only while :data:`HANDED_OVER_BYTES` are already waiting.

        Raises:
            OSError: an earlier queued write failed (the message names the file).
        """
        self._raise()
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="symfuse-write")
            if owner is not None:
                with self._done:
                    self._done.wait_for(lambda: self._handed_over < HANDED_OVER_BYTES)
                    self._handed_over += len(view)
                    self._in_flight += 1
                self._executor.submit(self._write_handed_over, view, offset, owner)
                return
            if self._free is None:  # the bounce buffers: only for copied writes
                self._free = queue.SimpleQueue()
                for _ in range(BOUNCE_BUFFERS):
                    self._free.put(_aligned_buffer())
            done = 0
            while done < len(view):
                n = min(BOUNCE_BYTES, len(view) - done)
                buf = self._free.get()  # waits while every buffer is in flight
                buf[:n] = view[done : done + n]
                with self._done:
                    self._in_flight += 1
                self._executor.submit(self._write_buffer, buf, n, offset + done)
                done += n

    def _write_handed_over(self, view: memoryview, offset: int, owner: object) -> None:  # in the writer thread
        try:
            if self._own is None:  # the writer thread's own buffer: never one a caller may be waiting for
                self._own = _aligned_buffer()
            done = 0
            while done < len(view) and self._error is None:
                n = min(BOUNCE_BYTES, len(view) - done)
                self._own[:n] = view[done : done + n]
                self._write_out(self._own, n, offset + done)
                done += n
        finally:  # ``owner`` (an argument of this call) is let go when it returns
            with self._done:
                self._handed_over -= len(view)
                self._in_flight -= 1
                self._done.notify_all()

    def _write_buffer(self, buf: memoryview, n: int, offset: int) -> None:  # in the writer thread
        try:
            self._write_out(buf, n, offset)
        finally:
            self._free.put(buf)  # type: ignore[union-attr]
            with self._done:
                self._in_flight -= 1
                self._done.notify_all()

    def _write_out(self, buf: memoryview, n: int, offset: int) -> None:  # in the writer thread
        """``buf[:n]`` at ``offset``: directly, or what is refused or short buffered; an error is kept to raise."""
        try:
            wrote = 0
            if self._fd >= 0 and self._error is None:
                try:
                    wrote = os.pwrite(self._fd, buf[:n], offset)
                    self.direct_bytes += wrote
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise write_error(self.path, exc.errno, exc.strerror) from exc
                    log.debug("%s: direct write refused (%s); buffered writes from now on", self.path, exc)
                    os.close(self._fd)  # only this thread writes through it
                    self._fd = -1
            if wrote < n and self._error is None:  # refused, or short: the rest buffered
                self._fallback(buf[wrote:n], offset + wrote)
        except BaseException as exc:  # raised to the caller by its next write or flush
            self._error = self._error or exc

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def flush(self) -> None:
        """Wait until every queued byte is written; raise the first error (naming the file)."""
        with self._done:
            self._done.wait_for(lambda: self._in_flight == 0)
        self._raise()

    def close(self) -> None:
        """Wait for queued writes, stop the writer thread, close the direct descriptor (idempotent; no raise)."""
        with self._done:
            self._done.wait_for(lambda: self._in_flight == 0)
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._free = self._own = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _aligned_buffer() -> memoryview:
    """A page-aligned buffer of :data:`BOUNCE_BYTES` (the view keeps its memory alive)."""
    raw = torch.empty(BOUNCE_BYTES + ALIGN, dtype=torch.uint8)
    skip = -raw.data_ptr() % ALIGN
    return memoryview(raw[skip : skip + BOUNCE_BYTES].numpy())
