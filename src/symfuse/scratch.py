"""Scratch folders that name their owner, so the ones a killed process left behind are found and removed.

A scratch folder is ``<tmp>/symfuse-scratch-<pid>-<process start, epoch s>-h<host>-<purpose>-<random>``: the owner is
in the name (nothing is written inside, so the whole folder can be uploaded as it is). ``<host>`` tags the machine and
PID namespace the pid belongs to: a folder made in another container or on another machine sharing the folder is
never judged by a pid of this one (its live scratch was removed). Folders named before the tag are judged as before.
A process killed with SIGKILL (an OOM kill, a crashed worker) never runs its cleanup; :func:`clean_stale_scratch`
removes such folders once their owner is gone (the pid runs no more, or runs another process started at another
time). It runs at the first scratch
folder of every process, at the start of every run (``clean-store``) and at ``deployments/stack.py start``.
Folders of live processes and folders without this name are never touched.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import psutil

log = logging.getLogger(__name__)

PREFIX = "symfuse-scratch-"
_NAME = re.compile(rf"^{PREFIX}(\d+)-(\d+)-(?:h([0-9a-f]{{8}})-)?")
_START_SLACK_S = 2  # psutil's start time of one process may differ by a rounding step between reads


def _start_time(pid: int) -> int | None:
    """When process ``pid`` started (whole epoch seconds), or None if no such process runs."""
    try:
        return int(psutil.Process(pid).create_time())
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    except psutil.AccessDenied:  # another user's process: it runs
        return -1


@functools.cache
def host_tag() -> str:
    """8 hex digits naming this machine and PID namespace (pids mean something only inside one)."""
    import hashlib
    import socket

    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # no /proc (macOS): the machine alone
        namespace = 0
    return hashlib.sha256(f"{socket.gethostname()}:{namespace}".encode()).hexdigest()[:8]


def owner_alive(pid: int, started: int) -> bool:
    """Whether the process that made a scratch folder (``pid`` started at ``started``) still runs."""
    now = _start_time(pid)
    return now is not None and (now == -1 or abs(now - started) <= _START_SLACK_S)


@contextlib.contextmanager
def scratch_dir(purpose: str, root: str | os.PathLike | None = None) -> Iterator[Path]:
    """A fresh local folder named after its owner (this process), removed afterwards.

    Args:
        purpose: A word in the folder's name (``merge``, ``eval``, ...).
        root: Parent folder (default the system's temporary folder).
    """
    _clean_once(str(root) if root is not None else None)
    pid = os.getpid()
    started = _start_time(pid)
    prefix = f"{PREFIX}{pid}-{max(started or 0, 0)}-h{host_tag()}-{purpose}-"
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir=root))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def linked_dir(folder: Path, files: Iterable[Path], purpose: str) -> Iterator[Path]:
    """A scratch folder with a symbolic link to each of ``files`` (paths inside ``folder``), at the same place.

    Uploads a part of a folder as a folder, without copying it first (the store follows links).
    """
    with scratch_dir(purpose) as tmp:
        view = tmp / folder.name
        for f in files:
            link = view / f.relative_to(folder)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(f.resolve())
        yield view


def clean_stale_scratch(root: str | os.PathLike | None = None) -> list[Path]:
    """Remove the scratch folders under ``root`` (default the temporary folder) whose owner process is gone.

    Returns:
        The removed folders.
    """
    base = Path(root) if root is not None else Path(tempfile.gettempdir())
    removed = []
    with contextlib.suppress(OSError):
        entries = list(base.iterdir())
        for entry in entries:
            match = _NAME.match(entry.name)
            if not match or entry.is_symlink() or not entry.is_dir():
                continue
            if match.group(3) not in (None, host_tag()) or owner_alive(int(match.group(1)), int(match.group(2))):
                continue  # another machine's or container's pid, or a live owner
            shutil.rmtree(entry, ignore_errors=True)
            if not entry.exists():
                removed.append(entry)
    if removed:
        log.info("removed %d scratch folder(s) left by killed processes under %s", len(removed), base)
    return removed


@functools.cache
def _clean_once(root: str | None) -> None:
    """:func:`clean_stale_scratch` once per process and root (at its first scratch folder)."""
    clean_stale_scratch(root)
