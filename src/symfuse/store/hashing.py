"""sha256 of stored files: what manifests record, and the check that a downloaded or local file still matches."""

from __future__ import annotations

import hashlib
from pathlib import Path

from symfuse.io.memo import FileMemo

_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    """The sha256 of a file's bytes (hex), read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


# Files whose sha256 this process already checked against a manifest, by settled identity (symfuse.io.memo): the
# same unchanged file is hashed once per process however many tasks read it; a rewrite is hashed again.
_VERIFIED: FileMemo[str] = FileMemo()


def matches_sha256(path: Path, expected: str) -> bool:
    """Whether ``path`` hashes to ``expected``, hashing an unchanged file at most once per process."""
    ident, known = _VERIFIED.lookup(path)
    if known == expected:
        return True
    digest = sha256_file(path)
    if digest == expected:
        _VERIFIED.remember(path, ident, digest)
    return digest == expected
