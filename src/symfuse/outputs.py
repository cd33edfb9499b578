"""Output folders that appear whole or not at all, with one writer at a time.

Every command and library function that writes a folder goes through :func:`atomic_output_dir`::

    with atomic_output_dir(out, overwrite=overwrite) as tmp:
        ...  # write into tmp
    # here out holds what was written to tmp, swapped in with one rename

* An existing ``out`` is refused unless ``overwrite`` (:class:`~symfuse.errors.OutputExistsError`), before any
  work when the caller claims the output first (:func:`claim_output`, :func:`check_output`).
* ``overwrite`` replaces only a folder symfuse wrote (it holds :data:`MARKER`, which every folder written here
  gets, listing the files written) or an empty one, and refuses one holding files the marker does not list (a
  user's notes added later), never the folder the command runs in or one of its parents, and never a folder that is
  or holds one of the command's inputs: a dataset, a hand-made checkpoint or the model being merged stay.
* The folder is written to a sibling ``.<name>.tmp-<pid>-<rand>`` and renamed onto ``out`` at the end; an old
  ``out`` (``overwrite``) is exchanged with the new one in one ``renameat2(RENAME_EXCHANGE)`` where the
  filesystem supports it, so it stays readable until the swap.
* Nothing the command did not create is deleted: if ``out`` appears (or is replaced) while the command runs, the
  commit fails and leaves it untouched.
* One writer per output: an ``fcntl.flock`` on the sibling ``.<name>.lock`` (it holds the writer's pid), taken at
  the claim, so a second writer fails at once with :class:`~symfuse.errors.OutputLockedError` naming the holder.
* Temporary folders are removed on failure, on SIGINT / SIGTERM (handlers installed while an output is claimed in
  the main thread; SIGTERM then ends the command with :class:`Terminated`), and, when a killed process left them,
  at the next claim of the same output (their pid is dead).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import logging
import os
import re
import secrets
import shutil
import signal
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from symfuse.errors import OutputExistsError, OutputLockedError, UsageError

log = logging.getLogger(__name__)

MARKER = ".symfuse-output"
"""The file every folder written through :func:`atomic_output_dir` holds: what ``overwrite`` may replace."""
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


class Terminated(SystemExit):
    """Raised in the main thread by the SIGTERM handler while an output is claimed (exit status 143)."""


@dataclass
class _Claim:
    out: Path
    lock: Path
    fd: int
    identity: tuple[int, int] | None  # (st_dev, st_ino) of ``out`` when claimed; None: it did not exist
    overwrite: bool
    created: list[Path] = field(default_factory=list)  # parent folders this claim made (removed if left empty)
    count: int = 1
    thread: int = field(default_factory=threading.get_ident)  # re-entered only by the thread that claimed it


_CLAIMS: dict[Path, _Claim] = {}
_TEMPS: set[Path] = set()
_STATE = threading.RLock()
_PUBLISHED: list[str] = []  # outputs this process finished: an interrupt after them leaves them whole


def mark_published(where: str | os.PathLike) -> None:
    """Record that the output ``where`` (a folder, file or store URI) is complete and in place.

    One inside an output still being written (:func:`atomic_output_dir`'s temporary folder) is not: it is in place
    only when that output is, and goes with it if that one is interrupted.
    """
    with _STATE:
        if "://" not in str(where) and any(t in Path(where).absolute().parents for t in _TEMPS):
            return
        _PUBLISHED.append(str(where))
        del _PUBLISHED[:-8]  # a long-lived worker writes many; a command a few


def clear_published() -> None:
    """Forget the outputs recorded so far (a command starting in a process that ran others)."""
    with _STATE:
        _PUBLISHED.clear()


def published() -> list[str]:
    """The outputs this process has completed so far (:func:`mark_published`), in order."""
    with _STATE:
        return list(_PUBLISHED)


_SAVED_HANDLERS: dict[int, object] = {}


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def lock_path(out: str | os.PathLike) -> Path:
    """The lock file of an output folder: ``.<name>.lock`` next to it."""
    out = Path(os.path.abspath(out))
    return out.parent / f".{out.name}.lock"


def _temp_pattern(name: str) -> re.Pattern[str]:
    # ours: .<name>.tmp-<pid>-<rand> and .<name>.old-<pid>-<rand>; a writer nested in ours (mkdtemp next to
    # our temp folder) adds one more leading dot: ..<name>.tmp-<pid>-<rand>.tmp-<rand>
    return re.compile(rf"^\.\.?{re.escape(name)}\.(?:tmp|old)-(\d+)-")


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def clean_stale_temps(out: str | os.PathLike) -> list[Path]:
    """Remove temporary folders of ``out`` left by killed writers (their pid is no longer alive).

    Returns:
        The removed folders.
    """
    out = Path(os.path.abspath(out))
    pattern = _temp_pattern(out.name)
    removed = []
    try:
        entries = list(out.parent.iterdir())
    except FileNotFoundError:
        return removed
    for p in entries:
        m = pattern.match(p.name)
        if m is None or _pid_alive(int(m.group(1))) or not p.is_dir() or p.is_symlink():
            continue
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
        log.info("removed %s, left by a killed writer (pid %s)", p, m.group(1))
    return removed


def check_output(out: str | os.PathLike, overwrite: bool = False, inputs: Sequence[object] = ()) -> Path:
    """Refuse an output path before any work: an existing ``out`` without ``overwrite``, a file, a bad parent.

    Args:
        out: The output folder.
        overwrite: Whether an existing folder may be replaced (at the end, atomically): only one symfuse wrote
            (it holds :data:`MARKER`) or an empty one, not the working folder or a parent of it, and not one that
            is or holds a path of ``inputs``.
        inputs: The command's inputs (paths; other entries, such as hub ids, never match a folder).

    Returns:
        ``out`` as an absolute path.

    Raises:
        OutputExistsError: ``out`` exists and ``overwrite`` is False or may not replace it, or ``out`` is not a
            folder.
        UsageError: ``out`` is empty, or a parent of ``out`` is a file.
    """
    if not os.fspath(out).strip():
        raise UsageError("--out is empty — give the output folder's path")
    path = Path(os.path.abspath(out))
    if path.is_symlink():  # the output is written beside it and renamed into place: it would replace the link
        raise OutputExistsError(
            f"{out}: is a symbolic link (to {os.readlink(path)}) — give the folder it points to, or another --out"
        )
    if path.exists() and not path.is_dir():
        raise OutputExistsError(f"{out}: exists and is not a folder — choose another --out")
    if path.exists() and not overwrite:
        raise OutputExistsError(f"{out}: already exists — pass --overwrite to replace it, or choose another --out")
    if path.exists():
        _check_replaceable(out, path, inputs)
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise UsageError(f"{out}: {parent} is a file, not a folder — choose another --out")
            break
    _check_name_length(out, path)
    return path


def _check_name_length(out: str | os.PathLike, path: Path) -> None:
    """Refuse a name whose temporary siblings (``.NAME.tmp-PID-XXXXXXXX`` and theirs) the file system cannot hold.

    It was found when the work ended and the output was written, naming the hidden temporary folder.
    """
    parent = next(p for p in path.parents if p.exists())
    try:
        limit = os.pathconf(parent, "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    # .NAME.tmp-PID-XXXXXXXX (a pid has up to 7 digits; .old- when it replaces one), and a library writer's own
    # staging sibling of that folder, .<it>.tmp-XXXXXXXX (disguise)
    extra = len(f"..tmp-{'0' * 7}-{'0' * 8}") + len(f"..tmp-{'0' * 8}")
    if (n := len(path.name.encode())) + extra > limit:
        raise UsageError(f"{out}: a name of {n} bytes — the folder written beside it first adds {extra}, and "
                         f"{parent} takes names of {limit}: give a name of at most {limit - extra}")  # fmt: skip


def _check_replaceable(out: str | os.PathLike, path: Path, inputs: Sequence[object]) -> None:
    """Refuse to replace the working folder (or a parent), an input (or a folder holding one) or a foreign folder."""
    real = Path(os.path.realpath(path))
    cwd = Path(os.path.realpath(os.getcwd()))
    if real == cwd or real in cwd.parents:
        raise OutputExistsError(f"{out}: is the folder this command runs in, or holds it — choose another --out")
    for item in inputs:
        if isinstance(item, str | os.PathLike) and os.fspath(item).strip():
            other = Path(os.path.realpath(item))
            if other == real or real in other.parents:
                raise OutputExistsError(
                    f"{out}: is or holds the input {os.fspath(item)}, which --overwrite would delete — "
                    "choose another --out"
                )
    try:
        names = os.listdir(path)
    except OSError as exc:
        raise OutputExistsError(f"{out}: cannot be read ({exc.strerror}) — choose another --out") from exc
    if names and MARKER not in names:
        raise OutputExistsError(
            f"{out}: --overwrite replaces only a folder symfuse wrote (it holds {MARKER}) or an empty one, and "
            "this one is neither — remove it yourself if it should go, or choose another --out"
        )
    if names and (added := _added_files(path)):
        shown = ", ".join(added[:3]) + (f" and {len(added) - 3} more" if len(added) > 3 else "")
        raise OutputExistsError(
            f"{out}: holds {shown}, which symfuse did not write there — --overwrite would delete them; move them "
            "out first, or choose another --out"
        )


_MARKER_HEAD = "written by symfuse: --overwrite may replace this folder"


def _files_under(folder: Path) -> list[str]:
    """Every file (and link) under ``folder``, as sorted relative POSIX paths, the marker aside."""
    found = []
    for root, dirs, files in os.walk(folder):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            found.append(Path(root, name).relative_to(folder).as_posix())
    return sorted(f for f in found if f != MARKER)


def _write_marker(folder: Path) -> None:
    """The marker: its head line, then every file written, one JSON string per line (what --overwrite may delete)."""
    lines = [_MARKER_HEAD, *(json.dumps(f) for f in _files_under(folder))]
    (folder / MARKER).write_text("\n".join(lines) + "\n")


def _added_files(folder: Path) -> list[str]:
    """Files under a symfuse output that its marker does not list (none when the marker lists nothing: older)."""
    try:
        listed = (folder / MARKER).read_text().splitlines()[1:]
        written = {json.loads(line) for line in listed if line.strip()}
    except (OSError, ValueError):
        return []  # an unreadable or older marker: the folder is symfuse's, as before
    if not written:
        return []
    return [f for f in _files_under(folder) if f not in written]


def _read_pid(fd: int) -> str:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return "unknown"
    return text if text.isdigit() else "unknown"


def _lock(out: Path, lock: Path) -> int:
    """Take the exclusive lock on ``lock`` (retrying if its previous holder unlinked it meanwhile)."""
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError) as exc:  # named: --out
            raise UsageError(
                f"{out}: cannot be written ({exc.strerror.lower() if exc.strerror else exc}: its lock file {lock.name} "
                f"could not be created in {lock.parent}) — choose an output in a folder you can write"
            ) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            holder = _read_pid(fd)
            os.close(fd)
            raise OutputLockedError(
                f"{out}: another symfuse process (pid {holder}) is writing it (lock {lock}) — "
                "wait for it to finish, or choose another --out"
            ) from exc
        # the holder before us unlinks the lock file when it releases: if ours is that unlinked file, retry
        if _identity(lock) == (os.fstat(fd).st_dev, os.fstat(fd).st_ino):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            return fd
        os.close(fd)


def _on_signal(signum: int, frame: FrameType | None) -> None:
    """Remove this process's temporary output folders, then end the command (its ``finally`` blocks run)."""
    with _STATE:
        temps = list(_TEMPS)
    for tmp in temps:
        shutil.rmtree(tmp, ignore_errors=True)
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Terminated(128 + signum)


def _install_handlers() -> None:
    if threading.current_thread() is not threading.main_thread() or _SAVED_HANDLERS:
        return
    for sig in (signal.SIGINT, signal.SIGTERM):
        _SAVED_HANDLERS[sig] = signal.signal(sig, _on_signal)


def _restore_handlers() -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    for sig, old in list(_SAVED_HANDLERS.items()):
        signal.signal(sig, old)  # type: ignore[arg-type]
        del _SAVED_HANDLERS[sig]


@contextlib.contextmanager
def claim_output(out: str | os.PathLike, overwrite: bool = False, inputs: Sequence[object] = ()) -> Iterator[Path]:
    """Hold the output's lock for the block, after refusing an existing ``out`` (unless ``overwrite``).

    Commands claim their ``--out`` before any work, so that a second writer fails at once and a refused output
    costs nothing; :func:`atomic_output_dir` inside the block re-enters the same claim. Stale temporary folders
    of ``out`` (dead pid) are removed. Parent folders the claim creates are removed again if nothing was written.

    Args:
        out: The output folder.
        overwrite: Whether an existing ``out`` may be replaced at the end (see :func:`check_output`).
        inputs: The command's inputs, which ``out`` may not be or hold.

    Yields:
        ``out`` as an absolute path.

    Raises:
        OutputExistsError: ``out`` exists and ``overwrite`` is False.
        OutputLockedError: another process holds the lock.
    """
    path = check_output(out, overwrite, inputs)
    with _STATE:
        claim = _CLAIMS.get(path)
        if claim is not None and claim.thread != threading.get_ident():
            raise OutputLockedError(
                f"{out}: another thread of this process (pid {os.getpid()}) is writing it — choose another --out"
            )
        if claim is not None:  # re-entered by the same thread (a command, then the library writer)
            claim.count += 1
    if claim is None:
        created = [p for p in (path.parent, *path.parent.parents) if not p.exists()]
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = lock_path(path)
        try:
            fd = _lock(Path(out), lock)
        except BaseException:
            _remove_empty(created)
            raise
        claim = _Claim(path, lock, fd, _identity(path), overwrite, created)
        with _STATE:
            _CLAIMS[path] = claim
            _install_handlers()
        try:
            clean_stale_temps(path)
            check_output(out, overwrite, inputs)  # it may have appeared before we held the lock
        except BaseException:
            _release(claim)
            raise
    try:
        yield path
    finally:
        _release(claim)


def _remove_empty(folders: list[Path]) -> None:
    for p in folders:  # deepest first
        with contextlib.suppress(OSError):
            p.rmdir()


def _release(claim: _Claim) -> None:
    with _STATE:
        claim.count -= 1
        if claim.count > 0:
            return
        _CLAIMS.pop(claim.out, None)
        if not _CLAIMS:
            _restore_handlers()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(claim.lock)  # while still holding it (see _lock)
    os.close(claim.fd)
    if not claim.out.exists():
        _remove_empty(claim.created)


def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    """``renameat2(src, dst, flags)``; False where the C library or the filesystem lacks it."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(dst))


def _commit(tmp: Path, claim: _Claim) -> None:
    out = claim.out
    if _identity(out) != claim.identity:
        raise OutputExistsError(
            f"{out}: appeared or was replaced while this command was writing it; it was left untouched — "
            "remove it or choose another --out, then run again"
        )
    if claim.identity is None:
        try:
            if not _renameat2(tmp, out, _RENAME_NOREPLACE):
                os.rename(tmp, out)  # we hold the lock and checked above: only a non-symfuse writer can race
        except FileExistsError as exc:
            raise OutputExistsError(
                f"{out}: appeared while this command was writing it; it was left untouched — choose another --out"
            ) from exc
        return
    if _renameat2(tmp, out, _RENAME_EXCHANGE):  # the old folder is now at tmp
        shutil.rmtree(tmp, ignore_errors=True)
        return
    old = out.parent / f".{out.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_output_dir(out: str | os.PathLike, overwrite: bool = False, inputs: Sequence[object] = ()) -> Iterator[Path]:
    """Yield an empty temporary folder next to ``out``; swap it onto ``out`` only if the block succeeds.

    Args:
        out: The output folder.
        overwrite: Replace an existing ``out`` (it stays readable until the final rename; see
            :func:`check_output`).
        inputs: The command's inputs, which ``out`` may not be or hold.

    Yields:
        The temporary folder to write into.

    Raises:
        OutputExistsError: ``out`` exists without ``overwrite``, or appeared / changed while writing.
        OutputLockedError: another process is writing ``out``.
    """
    with claim_output(out, overwrite, inputs) as path:
        with _STATE:
            claim = _CLAIMS[path]
        tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        tmp.mkdir()
        with _STATE:
            _TEMPS.add(tmp)
        try:
            yield tmp
            _write_marker(tmp)
            _commit(tmp, claim)
            mark_published(out)
        finally:
            with _STATE:
                _TEMPS.discard(tmp)
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
