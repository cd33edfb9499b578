"""Artifacts in any fsspec filesystem: writing (new versions, manifest last) and collecting unpublished versions.

See :mod:`symfuse.store.reader` for the layout and the reading side.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from symfuse.io.modes import umask
from symfuse.store.errors import ArtifactNotFound, CorruptArtifact
from symfuse.store.hashing import sha256_file
from symfuse.store.layout import MANIFEST
from symfuse.store.reader import JSON_FILE, ArtifactReader, default_cache_dir, default_root
from symfuse.store.versions import (
    VERSIONS,
    gc_grace,
    info_mtime,
    new_version,
    split_version_path,
    version_time,
)
from symfuse.store.versions import (
    keep_versions as keep_versions_setting,
)

log = logging.getLogger(__name__)

__all__ = ["JSON_FILE", "ArtifactStore", "default_cache_dir", "default_root"]


class ArtifactStore(ArtifactReader):
    """Folders of files with a manifest, under one fsspec root: :class:`ArtifactReader` plus versioned writes and gc.

    Constructor arguments, keys and URIs as for :class:`~symfuse.store.reader.ArtifactReader`, plus ``keep_versions``:
    how many versions a key keeps after a publish, the current one included (default
    :func:`~symfuse.store.versions.keep_versions`: ``$SYMFUSE_STORE_KEEP_VERSIONS`` or 2).

    Raises:
        ValueError: if ``keep_versions`` (or its variable) is not a whole number >= 1.
    """

    def __init__(
        self,
        root: str | os.PathLike | None = None,
        cache_dir: str | os.PathLike | None = None,
        keep_versions: int | None = None,
        **storage_options,
    ):
        if keep_versions is not None and (not isinstance(keep_versions, int) or keep_versions < 1):
            raise ValueError(f"keep_versions={keep_versions!r}: keep at least the current version (>= 1)")
        self.keep_versions = keep_versions_setting() if keep_versions is None else keep_versions
        super().__init__(root, cache_dir, **storage_options)

    # ----------------------------------------------------------------------------------------------- writing
    def put_dir(
        self,
        key: str,
        local_dir: str | os.PathLike,
        producer: str,
        inputs: Mapping[str, str] | None = None,
        content_key: str | None = None,
        meta: Mapping[str, Any] | None = None,
        move: bool = False,
        stage: bool = False,
    ) -> str:
        """Upload every file under ``local_dir`` as a new version of the artifact ``key``, then publish it.

        The files go to a fresh version folder; the manifest naming it is written last. Until then readers see the
        previous version, whole; a killed upload leaves an unpublished version that :meth:`gc` removes later.
        A top-level ``manifest.json`` in ``local_dir`` is the store's own (``local_dir`` came from
        :meth:`local_cache` of an old-layout local store) and is not uploaded.

        Args:
            key: Key or URI.
            local_dir: Folder to upload (recursively; symlinks followed).
            producer: Who made it (task name, ``symfuse match``, ...).
            inputs: Name -> URI of the artifacts it was computed from.
            content_key: The stage's :func:`~symfuse.store.layout.content_key`, checked by :meth:`exists`.
            meta: Extra JSON-able facts to keep in the manifest.
            move: The files are the caller's to give away (a task's scratch output): a local store on the same file
                system renames them into the version instead of copying them (``local_dir`` is left without them).
                Symlinks, other file systems and remote stores copy as usual.
            stage: Write the version and its manifest beside it, leaving the artifact's current version alone:
                the returned staged URI (``<uri>/.v/<version>``) reads it, :meth:`publish` makes it current.

        Returns:
            The artifact's URI (``stage``: the staged URI).

        Raises:
            FileNotFoundError: if ``local_dir`` is not a folder.
        """
        self._writable(key)
        src = Path(local_dir)
        if not src.is_dir():
            raise FileNotFoundError(f"cannot store {src} as {self.uri(key)}: not a folder")
        if self.is_local and src.resolve().is_relative_to(Path(self._path(key)).resolve()):
            raise ValueError(f"cannot store {src} as {self.uri(key)}: it is (inside) that artifact's own folder")
        files = sorted(p.relative_to(src).as_posix() for p in src.rglob("*") if p.is_file())
        if MANIFEST in files:  # src is itself an artifact (local_cache of a local store): its manifest is not data
            log.info("not uploading %s: %s is the store's own file", src / MANIFEST, MANIFEST)
            files = [f for f in files if f != MANIFEST and not (f.startswith(f".{MANIFEST}.") and f.endswith(".tmp"))]
        version = new_version()
        sizes, sha = {}, {}
        # symlinks first: they are copied, and may point at a file of src that ``move`` renames away
        for rel in sorted(files, key=lambda r: not (src / r).is_symlink()):
            sizes[rel] = (src / rel).stat().st_size
            sha[rel] = sha256_file(src / rel)
            with self._io(f"{self.uri(key)}/{rel}"):
                self._put(src / rel, self._path(key, VERSIONS, version, rel), move)
        return self._publish(key, version, files, sizes, sha, producer, inputs, content_key, meta, stage)

    def put_file(
        self,
        key: str,
        local_file: str | os.PathLike,
        producer: str,
        inputs: Mapping[str, str] | None = None,
        content_key: str | None = None,
        meta: Mapping[str, Any] | None = None,
        move: bool = False,
        stage: bool = False,
    ) -> str:
        """Upload one file as the artifact ``key`` (a folder holding that file, under its own name).

        ``move`` and ``stage`` as for :meth:`put_dir`; the other arguments too.

        Returns:
            The artifact's URI (``stage``: the staged URI); :meth:`get_file` gives the file back.
        """
        self._writable(key)
        file = Path(local_file)
        if not file.is_file():
            raise FileNotFoundError(f"cannot store {file} as {self.uri(key)}: not a file")
        if file.name == MANIFEST:
            raise ValueError(f"{file}: the name {MANIFEST} is reserved for the store")
        version = new_version()
        sizes, sha = {file.name: file.stat().st_size}, {file.name: sha256_file(file)}
        with self._io(f"{self.uri(key)}/{file.name}"):
            self._put(file, self._path(key, VERSIONS, version, file.name), move)
        return self._publish(key, version, [file.name], sizes, sha, producer, inputs, content_key, meta, stage)

    def _put(self, src: Path, dest: str, move: bool) -> None:
        """Copy ``src`` to ``dest`` in the store, or rename it there (``move``, a local store, one file system)."""
        if move and self.is_local and not src.is_symlink():
            Path(dest).parent.mkdir(parents=True, exist_ok=True)
            try:
                os.rename(src, dest)  # dest is in a fresh version folder: nothing of anyone else's is replaced
            except OSError as exc:
                if exc.errno != errno.EXDEV:  # another file system: copy below
                    raise
            else:
                os.chmod(dest, 0o666 & ~umask())  # the mode a copy gets (a scratch file may be private: mkstemp)
                return
        self.fs.put_file(str(src), dest)

    def put_json(
        self,
        key: str,
        obj: Any,
        producer: str,
        inputs: Mapping[str, str] | None = None,
        content_key: str | None = None,
        meta: Mapping[str, Any] | None = None,
        stage: bool = False,
    ) -> str:
        """Store a JSON-able object as the artifact ``key`` (one file, ``data.json``); ``stage`` as for :meth:`put_dir`.

        Returns:
            The artifact's URI (``stage``: the staged URI).
        """
        self._writable(key)
        raw = json.dumps(obj, indent=1, sort_keys=True, default=str).encode()
        version = new_version()
        with self._io(f"{self.uri(key)}/{JSON_FILE}"):
            self.fs.pipe_file(self._path(key, VERSIONS, version, JSON_FILE), raw)
        sizes, sha = {JSON_FILE: len(raw)}, {JSON_FILE: hashlib.sha256(raw).hexdigest()}
        return self._publish(key, version, [JSON_FILE], sizes, sha, producer, inputs, content_key, meta, stage)

    def _writable(self, key: str) -> None:
        """Refuse a staged URI as a write target (a version is written once; publish it with :meth:`publish`)."""
        if self.split_staged(key)[1] is not None:
            raise ValueError(f"{key}: names one version of an artifact; write to {self.uri(key)} instead")

    def _publish(
        self,
        key: str,
        version: str,
        files: list[str],
        sizes: dict[str, int],
        sha: dict[str, str],
        producer: str,
        inputs: Mapping[str, str] | None,
        content_key: str | None,
        meta: Mapping[str, Any] | None,
        stage: bool = False,
    ) -> str:
        """Write the manifest naming ``version`` (atomically), then tidy the key (:meth:`_tidy`).

        ``stage``: the manifest goes beside the version's files instead; returns the staged URI.
        """
        manifest = {
            "version": version,
            "files": files,
            "sizes": sizes,
            "sha256": sha,
            "producer": producer,
            "inputs": dict(inputs or {}),
            "content_key": content_key,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "meta": dict(meta or {}),
        }
        if stage:
            self._write_manifest(key, manifest, VERSIONS, version)
            log.debug("staged %s (%d files, version %s) by %s", self.uri(key), len(files), version, producer)
            return self.staged_uri(key, version)
        self._make_current(key, manifest)
        log.debug("stored %s (%d files, version %s) by %s", self.uri(key), len(files), version, producer)
        return self.uri(key)

    def _make_current(self, key: str, manifest: Mapping[str, Any]) -> None:
        """Write ``manifest`` as the artifact's own (its version becomes current), then tidy the key.

        The manifest records the versions that were current before (``previous``, newest first) as far as the
        retention keeps them; the older ones are removed right after (:meth:`_tidy`).
        """
        try:
            previous = self.manifest(key)
        except (ArtifactNotFound, CorruptArtifact):
            previous = None
        history = []
        if previous is not None and previous.get("version") not in (None, manifest["version"]):
            history = [previous["version"], *previous.get("previous", [])]
        history = [v for i, v in enumerate(history) if version_time(v) and v not in (manifest["version"], *history[:i])]
        kept, dropped = history[: self.keep_versions - 1], history[self.keep_versions - 1 :]
        manifest = {**manifest, "previous": kept}
        self._write_manifest(key, manifest)
        self._tidy(key, previous, manifest["version"], dropped)

    def _write_manifest(self, key: str, manifest: Mapping[str, Any], *folder: str) -> None:
        """Write ``<key>/[folder/]manifest.json`` in one atomic step (a reader never sees half of it)."""
        raw = json.dumps(manifest, indent=1, sort_keys=True).encode()
        path = self._path(key, *folder, MANIFEST)
        with self._io(f"{self.uri(key)}/{MANIFEST}"):
            if self.is_local:  # write + rename, so a reader never sees half a manifest
                tmp = Path(self._path(key, *folder, f".{MANIFEST}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"))
                tmp.parent.mkdir(parents=True, exist_ok=True)
                tmp.write_bytes(raw)
                os.replace(tmp, path)
            else:  # one PUT: object stores make it visible whole or not at all
                self.fs.pipe_file(path, raw)

    def publish(self, staged: Sequence[str]) -> list[str]:
        """Make each staged version (``put_*(..., stage=True)``) current: all of them, or none if one is not whole.

        Every staged version is checked first (its manifest and every file it lists present); only then the
        manifests move, one atomic write each, in the order given (publish the artifact that vouches for the others,
        e.g. a run's record, last). A URI that is no staged URI, or whose version is current already, is left as it
        is. The replaced versions stay until :meth:`gc` collects them.

        Returns:
            The artifacts' URIs, in order.

        Raises:
            ArtifactNotFound: if a staged version is gone (never staged, or collected): nothing was published.
            CorruptArtifact: if a file a staged manifest lists is missing: nothing was published.
        """
        ready = []
        for uri in staged:
            key, version = self.split_staged(uri)
            if version is None:
                continue
            manifest = self.manifest(uri)
            folder = self._path(key, VERSIONS, version)
            with self._io(self.staged_uri(key, version)):
                present = {self._rel(p) for p in self.fs.find(folder)} if self.fs.exists(folder) else set()
            missing = [f for f in manifest["files"] if self._rel(f"{folder}/{f}") not in present]
            if missing:
                raise CorruptArtifact(f"{uri}: {len(missing)} file(s) it lists are missing ({missing[0]}, ...); "
                                      "nothing was published: run again")  # fmt: skip
            ready.append((key, version, manifest))
        for key, version, manifest in ready:
            try:
                current = self.manifest(key).get("version")
            except (ArtifactNotFound, CorruptArtifact):
                current = None
            if current != version:
                self._make_current(key, manifest)
                log.debug("published %s (version %s)", self.uri(key), version)
            staged_manifest = self._path(key, VERSIONS, version, MANIFEST)
            try:  # the version is the artifact's now; its staged URI reads the artifact's manifest
                with self._io(self.staged_uri(key, version)):
                    self.fs.rm_file(staged_manifest)
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("%s is published; removing its staged manifest failed: %s", self.uri(key), exc)
        return [self.uri(uri) for uri in staged]

    def _tidy(self, key: str, previous: Mapping[str, Any] | None, version: str, dropped: Sequence[str] = ()) -> None:
        """After publishing: remove replaced old-layout files, versions beyond the retention, expired versions.

        ``dropped`` are once-current versions beyond the retention: fully written, no writer's, never the current one.

        Failures are logged, not raised: the new version is published already.
        """
        try:
            with self._io(self.uri(key)):
                if previous is not None and previous.get("version") is None:
                    for rel in previous["files"]:
                        if self.fs.exists(self._path(key, rel)):
                            self.fs.rm_file(self._path(key, rel))
                for old in dropped:
                    if old != version and self.fs.exists(self._path(key, VERSIONS, old)):
                        self.fs.rm(self._path(key, VERSIONS, old), recursive=True)
                        log.info("retention: removed replaced version %s/%s/%s (keeping %d)", self.uri(key),
                                 VERSIONS, old, self.keep_versions)  # fmt: skip
                self.gc(key, keep=(version,))
        except (OSError, ValueError) as exc:
            log.warning("%s is published; tidying its old files failed: %s", self.uri(key), exc)

    def delete(self, key: str) -> None:
        """Remove an artifact: its manifest first (so it stops existing at once), then all its versions.

        Deleting a key that holds nothing is not an error. A writer uploading to ``key`` at the same moment loses
        its files: delete keys no task is writing.
        """
        base = self._path(key)
        with self._io(self.uri(key)):
            if self.fs.exists(f"{base}/{MANIFEST}"):
                self.fs.rm_file(f"{base}/{MANIFEST}")
            if self.fs.exists(base):
                self.fs.rm(base, recursive=True)

    # ----------------------------------------------------------------------------------------------- collecting
    def gc(self, prefix: str = "", grace_s: float | None = None, keep: tuple[str, ...] = ()) -> list[str]:
        """Remove versions no manifest points to (killed uploads, replaced artifacts), once older than a grace period.

        Never removes the version a manifest points to, a version younger than ``grace_s`` (by its id's time and its
        newest file: it may belong to a writer still uploading), or a folder whose name is not a symfuse version id.

        Args:
            prefix: A key or key prefix (``runs/demo``); ``""`` collects the whole store.
            grace_s: Minimum age in seconds; default :func:`~symfuse.store.versions.gc_grace`
                (``$SYMFUSE_STORE_GC_GRACE`` or 3600).
            keep: Version ids never to remove (a writer's own).

        Returns:
            The URIs of the removed version folders.
        """
        grace = gc_grace() if grace_s is None else grace_s
        base = self._path(prefix) if prefix.strip("/") else self.path
        with self._io(f"{self.root}/{prefix}"):
            found = self.fs.find(base, detail=True) if self.fs.exists(base) else {}
        newest: dict[str, dict[str, float]] = {}
        for path, info in found.items():
            where = split_version_path(self._rel(path))
            if where is not None:
                born = version_time(where[1])
                if born is not None:
                    versions = newest.setdefault(where[0], {})
                    versions[where[1]] = max(versions.get(where[1], born), info_mtime(info) or born)
        now, removed = time.time(), []
        for key, versions in sorted(newest.items()):
            old = [v for v, t in sorted(versions.items()) if v not in keep and now - t >= grace]
            for version in old:
                try:  # read the manifest right before removing: a writer may have published meanwhile
                    current = self.manifest(key).get("version")
                except ArtifactNotFound:
                    current = None
                except CorruptArtifact:
                    log.warning("gc: %s has a damaged manifest; leaving its versions alone", self.uri(key))
                    break
                if version == current:
                    continue
                with self._io(f"{self.uri(key)}/{VERSIONS}/{version}"):
                    self.fs.rm(self._path(key, VERSIONS, version), recursive=True)
                removed.append(f"{self.uri(key)}/{VERSIONS}/{version}")
                log.info("gc: removed unpublished version %s/%s/%s", self.uri(key), VERSIONS, version)
        return removed
