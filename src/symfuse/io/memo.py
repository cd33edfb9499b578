"""Per-process memos of facts about unchanged files: a sha256 already checked, a file already found finite.

A file is known by its identity ``(device, inode, size, mtime_ns, ctime_ns)``. A rewrite changes it: a replacement
by rename changes the inode; an in-place write moves mtime and ctime; setting the mtime back still moves the ctime.
Only files whose inode changed long enough before the check are remembered: a rewrite within the same tick of the
file system's clock could keep both times (the "racy" entries of git's index), so a file that fresh is checked every
time until it settles. How long is long enough depends on the clock: :data:`FINE_SETTLED_NS` where the file's times
have a sub-millisecond part (ext4, xfs, btrfs, tmpfs: the kernel's coarse clock ticks every 1-10 ms), else
:data:`SETTLED_NS` (file systems that keep whole seconds, FAT's 2 s, some network mounts).

Used by :func:`symfuse.io.check_finite` and by the artifact store's sha256 verification: one rule for both.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Generic, TypeVar

V = TypeVar("V")

SETTLED_NS = 2_000_000_000  # times without a sub-millisecond part: a coarse file system clock
FINE_SETTLED_NS = 100_000_000  # sub-millisecond times: ten ticks of a 100 Hz kernel clock

Identity = tuple[int, int, int, int, int]


def settled_identity(path: str | os.PathLike) -> Identity | None:
    """The file's identity, or None if it changed too recently to be remembered safely (see the module docstring).

    Raises:
        OSError: if the file cannot be stat'ed.
    """
    st = os.stat(path)
    fine = st.st_mtime_ns % 1_000_000 or st.st_ctime_ns % 1_000_000
    if time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) < (FINE_SETTLED_NS if fine else SETTLED_NS):
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class FileMemo(Generic[V]):
    """Facts about files, valid while the file keeps its settled identity; thread-safe.

    Usage::

        ident, known = memo.lookup(path)
        if known != wanted:
            fact = expensive(path)
            memo.remember(path, ident, fact)  # kept only if the file did not change while it was read
    """

    def __init__(self) -> None:
        self._facts: dict[Identity, V] = {}
        self._lock = threading.Lock()

    def lookup(self, path: str | os.PathLike) -> tuple[Identity | None, V | None]:
        """The file's settled identity (None if too fresh) and the fact remembered for it (None if none)."""
        ident = settled_identity(path)
        if ident is None:
            return None, None
        with self._lock:
            return ident, self._facts.get(ident)

    def remember(self, path: str | os.PathLike, ident: Identity | None, fact: V) -> None:
        """Keep ``fact`` for the file if ``ident`` (from :meth:`lookup` before the work) still names it."""
        if ident is not None and settled_identity(path) == ident:
            with self._lock:
                self._facts[ident] = fact

    def clear(self) -> None:
        """Forget everything (tests; a process that knows its files were replaced)."""
        with self._lock:
            self._facts.clear()
