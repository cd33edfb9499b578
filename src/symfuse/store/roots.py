"""Checks of store roots and of store URIs a run is given, before any work (one line each, or None)."""

from __future__ import annotations

import os
from pathlib import Path

from symfuse.io.modes import can_create_in, creation_refused, nearest_existing
from symfuse.store.urls import store_url_problem


def store_root_problem(root: str, label: str, fix: str) -> str | None:
    """Why a store root cannot be written (``<label> <root>: <what> — <fix>``), or None.

    A local root must be a folder, or a path whose nearest existing parent is a writable folder. A URL other than
    ``file://`` is checked for its scheme and for a credential inside it
    (:func:`~symfuse.store.urls.store_url_problem`); it is reached when first written.

    Args:
        root: The store root (a path or URL).
        label: What the user gave it as (``store_root``, ``--store``).
        fix: The end of the line: what to give instead.

    Returns:
        One line naming the root, what is wrong and ``fix``; None when the root is usable.
    """
    scheme, sep, rest = root.partition("://")
    if sep and ((problem := store_url_problem(root, label)) is not None or scheme != "file"):
        return problem
    path = Path(os.path.expanduser(rest if sep else root))  # Path.expanduser raises for ~user of no such user
    probe = nearest_existing(path)
    if not probe.is_dir():
        what = "is a file" if probe == path else f"is under {probe}, which is a file"
        return f"{label} {root}: {what} — {fix}"
    if not can_create_in(probe):
        return f"{label} {root}: {probe} is not writable by this user — {fix}"
    if why := creation_refused(probe):  # found after the fine-tunes, as "access denied; check the AWS_* credentials"
        return f"{label} {root}: no file can be created in {probe} ({why}) — {fix}"
    return None


def brought_uri_problem(root: str, checkpoint: str) -> str | None:
    """Why a checkpoint given as a URI cannot be brought into a run storing under ``root`` (``<uri>: ...``), or None.

    A run brings a local folder, a ``.gguf``, a hub id or an artifact of its own store. A URI outside the store
    root failed when the run brought it, while the other fine-tunes trained on. An artifact under a local root must
    be there; one under a remote root is read when the run brings it (no network call here).

    Args:
        root: The run's store root.
        checkpoint: The checkpoint as the config gives it (a URI: it holds ``://``).
    """
    from symfuse.store import ArtifactStore

    fix = "give a local folder, a .gguf file, a hub id or an artifact of the run's store"
    if store_root_problem(root, "store_root", fix) is not None:
        return None  # the root's own line says what is wrong
    store = ArtifactStore(root)
    try:
        store.key(checkpoint)
    except ValueError:
        return f"{checkpoint}: not under the run's store root {root} — {fix} (download it first)"
    if store.is_local and not store.exists(checkpoint):
        return f"{checkpoint}: no complete artifact there (no manifest) — {fix}"
    return None
