"""Permissions: what symfuse writes gets the mode a plain ``mkdir`` / ``open`` gives; what it cannot read is named.

Outputs are written under temporary names and renamed into place. ``tempfile.mkdtemp`` / ``mkstemp`` make those
temporaries private (0700 / 0600) whatever the umask, and the rename keeps that mode, so another user (or a worker
of a pool running as one) could not read a merged model. :func:`plain_mode` gives a finished temporary the mode a
plain ``os.mkdir`` / ``open`` would have given it (``0o777`` / ``0o666`` less the umask), just before its rename:
nothing is loosened while it is half-written.

A file this user may not read is one line, :func:`not_readable` (raised by :func:`check_readable`, and by the
readers that meet a ``PermissionError``): safetensors' own loader reports it as a missing file.
"""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

from symfuse.errors import CheckpointError

_UMASK_LOCK = threading.Lock()


def umask() -> int:
    """The process's umask, read without changing it where the system shows it (Linux ``/proc/self/status``).

    Elsewhere it is set to ``0o077`` (never looser) and restored at once, under a lock.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    with _UMASK_LOCK:
        mask = os.umask(0o077)
        os.umask(mask)
    return mask


def plain_mode(path: str | os.PathLike) -> None:
    """Give ``path`` the permissions ``os.mkdir`` (a folder) or ``open`` (a file) would have given it.

    ``0o777 & ~umask`` for a folder, ``0o666 & ~umask`` for a file; set-id and sticky bits it has (a folder's
    inherited set-group-id) are kept.
    """
    st = os.stat(path)
    base = 0o777 if stat.S_ISDIR(st.st_mode) else 0o666
    os.chmod(path, (stat.S_IMODE(st.st_mode) & 0o7000) | (base & ~umask()))


def nearest_existing(path: str | os.PathLike) -> Path:
    """``path`` if it exists, else its nearest ancestor that does: where creating ``path`` is decided."""
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return probe


def can_create_in(folder: str | os.PathLike) -> bool:
    """Whether this user may create files and folders in ``folder`` (write and search permission)."""
    return os.access(folder, os.W_OK | os.X_OK)


def creation_refused(folder: str | os.PathLike) -> str | None:
    """Why the file system refuses a new file in ``folder`` though permissions may allow it, or None.

    Root in ``/proc`` or ``/sys``, a read-only or root-squashed mount: a temporary file is created and removed.
    """
    import tempfile

    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".symfuse-write-check-")
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    os.close(fd)
    os.unlink(probe)
    return None


def not_readable(file: str | os.PathLike) -> CheckpointError:
    """The one-line error for a file this user may not read (``PermissionError``)."""
    return CheckpointError(
        f"{file}: not readable by this user (permission denied) — fix its permissions (chmod a+r) or run as its owner"
    )


def check_readable(file: str | os.PathLike) -> None:
    """Open ``file`` for reading and close it: a permission problem is named before a library misreports it.

    Raises:
        CheckpointError: this user may not read ``file`` (:func:`not_readable`).
    """
    try:
        os.close(os.open(file, os.O_RDONLY))
    except PermissionError as exc:
        raise not_readable(file) from exc
