"""Versions of an artifact: every write goes to a fresh ``<key>/.v/<version>/`` folder, the manifest points to one.

A version id is ``<UTC time to the millisecond>Z-<16 random hex digits>`` (``20261123T211455123Z-9f...``), so two
writers never share one and :func:`version_time` tells a version's age without asking the backend. Versions no
manifest points to (a killed upload, a replaced artifact, the loser of a race) are removed by
:meth:`~symfuse.store.ArtifactStore.gc` once older than a grace period (``SYMFUSE_STORE_GC_GRACE`` seconds,
default one hour), so a writer still uploading (its version is young) is never disturbed.

Retention: right after a publish, the key keeps its :func:`keep_versions` newest versions up to the current one
(``SYMFUSE_STORE_KEEP_VERSIONS``, default 2: the current one and the one it replaced, which a reader may still be
downloading); older ones go at once, without waiting for the grace period (see
:meth:`~symfuse.store.ArtifactStore.prune`).
"""

from __future__ import annotations

import calendar
import datetime
import os
import re
import time
import uuid
from collections.abc import Mapping
from typing import Any

from symfuse.store.errors import CorruptArtifact

VERSIONS = ".v"
GRACE_ENV = "SYMFUSE_STORE_GC_GRACE"
DEFAULT_GRACE_S = 3600.0
KEEP_ENV = "SYMFUSE_STORE_KEEP_VERSIONS"
DEFAULT_KEEP = 2
_VERSION = re.compile(r"^(\d{8}T\d{6})(\d{3})Z-[0-9a-f]{16}$")


def new_version() -> str:
    """A fresh, unique version id holding the current UTC time."""
    now = time.time()
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now))
    return f"{stamp}{int(now * 1000) % 1000:03d}Z-{uuid.uuid4().hex[:16]}"


def version_time(version: str) -> float | None:
    """When a version was started (epoch seconds), or ``None`` if ``version`` is not a symfuse version id."""
    match = _VERSION.match(version)
    if not match:
        return None
    return calendar.timegm(time.strptime(match.group(1), "%Y%m%dT%H%M%S")) + int(match.group(2)) / 1000


def check_version(version: Any, where: str) -> str:
    """A manifest's ``version`` field, validated (it becomes a path segment).

    Raises:
        CorruptArtifact: if it is not a version id.
    """
    if not isinstance(version, str) or not _VERSION.match(version):
        raise CorruptArtifact(f"{where}: manifest names version {version!r}, not a symfuse version id; rewrite it")
    return version


def info_mtime(info: Mapping[str, Any]) -> float | None:
    """Modification time (epoch seconds) of a file as fsspec describes it, ``None`` if the backend gives none.

    Local files have ``mtime``, s3 objects ``LastModified``, memory files ``created``.
    """
    for name in ("mtime", "LastModified", "created"):
        value = info.get(name)
        if isinstance(value, datetime.datetime):
            return value.timestamp() if value.tzinfo else value.replace(tzinfo=datetime.UTC).timestamp()
        if isinstance(value, int | float):
            return float(value)
    return None


def gc_grace() -> float:
    """Grace period of :meth:`~symfuse.store.ArtifactStore.gc` in seconds: ``$SYMFUSE_STORE_GC_GRACE`` or 3600.

    Raises:
        ValueError: if the variable is not a number >= 0 (one line naming it).
    """
    raw = os.environ.get(GRACE_ENV, "").strip()
    if not raw:
        return DEFAULT_GRACE_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(f"{GRACE_ENV}={raw!r} is not a number of seconds >= 0; set e.g. {GRACE_ENV}=3600")
    return value


def keep_versions() -> int:
    """How many versions a key keeps after a publish (the current one included): ``$SYMFUSE_STORE_KEEP_VERSIONS`` or 2.

    Raises:
        ValueError: if the variable is not a whole number >= 1 (one line naming it).
    """
    raw = os.environ.get(KEEP_ENV, "").strip()
    if not raw:
        return DEFAULT_KEEP
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{KEEP_ENV}={raw!r} is not a whole number >= 1; set e.g. {KEEP_ENV}=2 (1: current only)")
    return int(raw)


def split_version_path(rel: str) -> tuple[str, str] | None:
    """``(key, version)`` of a path relative to the store root inside a version folder, else ``None``."""
    parts = rel.strip("/").split("/")
    if VERSIONS not in parts:
        return None
    i = parts.index(VERSIONS)
    if i == 0 or i + 1 >= len(parts):
        return None
    return "/".join(parts[:i]), parts[i + 1]
