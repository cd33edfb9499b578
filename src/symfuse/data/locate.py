"""Where a bare dataset name is found: ``$SYMFUSE_DATASETS``, ``../shared/datasets``, then the bundled demo data.

An explicit path always wins (checked by the caller) and a hub id (``owner/name``, ``hf:<id>``) comes last; see
:mod:`symfuse.data.dataset`. ``$SYMFUSE_SHARED_DATASETS`` replaces the ``../shared/datasets`` location (an empty value
skips it), so a test can simulate a clone that has no ``../shared`` next to it.
"""

from __future__ import annotations

import difflib
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

__all__ = [
    "BUNDLED_DIR",
    "SHARED_ENV",
    "bundled_datasets",
    "dataset_search_path",
    "find_named_dataset",
    "not_found_message",
    "shared_datasets_dir",
    "shared_location",
]

SHARED_ENV = "SYMFUSE_SHARED_DATASETS"
BUNDLED_DIR = Path(__file__).resolve().parent / "demo"


def shared_location() -> Path | None:
    """The ``../shared/datasets`` folder, or None when there is none.

    ``$SYMFUSE_SHARED_DATASETS`` replaces the lookup (an empty value: no shared folder; tests use it to simulate a
    clone without ``../shared``); else the first existing ``shared/datasets`` inside or next to the repository,
    then inside or next to the working directory.
    """
    env = os.environ.get(SHARED_ENV)
    if env is not None:
        return Path(env) if env and Path(env).is_dir() else None
    repo = Path(__file__).resolve().parents[3]
    for cand in (
        repo / "shared" / "datasets",
        repo.parent / "shared" / "datasets",
        Path.cwd() / "shared" / "datasets",
        Path.cwd().parent / "shared" / "datasets",
    ):
        if cand.is_dir():
            return cand
    return None


def dataset_search_path() -> list[tuple[str, Path]]:
    """Where a bare dataset name is looked up, in order: ``(what, folder)`` for each location that exists.

    ``$SYMFUSE_DATASETS``, then the shared folder (:func:`shared_location`), then the bundled demo data.
    """
    out: list[tuple[str, Path]] = []
    env = os.environ.get("SYMFUSE_DATASETS")
    if env and Path(env).is_dir():
        out.append(("$SYMFUSE_DATASETS", Path(env)))
    shared = shared_location()
    if shared is not None:
        out.append(("shared", shared))
    if BUNDLED_DIR.is_dir():
        out.append(("bundled", BUNDLED_DIR))
    return out


def bundled_datasets() -> list[str]:
    """Names of the demo datasets shipped inside the package."""
    return sorted(p.name for p in BUNDLED_DIR.iterdir() if (p / "meta.json").is_file()) if BUNDLED_DIR.is_dir() else []


def find_named_dataset(name: str) -> Path | None:
    """The folder a bare dataset name resolves to (first hit of :func:`dataset_search_path`), or None."""
    for what, folder in dataset_search_path():
        if (folder / name).is_dir() and (what != "bundled" or name in bundled_datasets()):
            log.debug("%s: %s dataset %s", name, what, folder / name)
            return folder / name
    return None


def shared_datasets_dir() -> Path | None:
    """The first datasets folder outside the package: ``$SYMFUSE_DATASETS``, else :func:`shared_location`."""
    env = os.environ.get("SYMFUSE_DATASETS")
    return Path(env) if env else shared_location()


def not_found_message(name: str) -> str:
    """The one-line message for a bare name that no location holds (what was searched, what to provide)."""
    env = os.environ.get("SYMFUSE_DATASETS")
    shared = shared_location()
    names = sorted({p.name for w, f in dataset_search_path() if w != "bundled" for p in f.iterdir() if p.is_dir()})
    names = sorted({*names, *bundled_datasets()})
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.75)
    searched = [
        f"$SYMFUSE_DATASETS={env}" if env else "$SYMFUSE_DATASETS (unset)",
        str(shared) if shared else f"../shared/datasets (absent; ${SHARED_ENV} moves it)",
        f"bundled demo data ({', '.join(bundled_datasets())})",
    ]
    hint = f"did you mean {', '.join(close)}?" if close else f"available: {', '.join(names) or 'none'}"
    return (
        f"{name}: no dataset of that name ({hint}); searched {'; '.join(searched)}. Give a dataset folder or file "
        f"path, put {name}/ in $SYMFUSE_DATASETS or ../shared/datasets, or use a hub id (owner/name or hf:{name}, "
        "online)"
    )
