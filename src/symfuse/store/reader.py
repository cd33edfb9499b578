"""Artifacts in any fsspec filesystem: a local folder, ``s3://bucket/prefix`` (s3fs) or ``memory://`` in tests.

An artifact is ``<key>/manifest.json`` (``version``, ``files``, ``sizes``, ``sha256``, ``producer``, ``inputs``,
``content_key``, ``created``, ``meta``) pointing to its data files under ``<key>/.v/<version>/`` (see
:mod:`symfuse.store.versions`). A writer uploads into a version of its own, then publishes it by writing the manifest
LAST, in one atomic step (rename on local disks, one PUT on object stores). Hence:

- an artifact without its manifest does not exist for readers, and a killed upload is never readable;
- the previous version stays readable, whole, until the new manifest replaces it (never delete-then-write);
- two writers of one key never mix: the last manifest wins and names one complete version.

Readers resolve the manifest, then read that version's files and verify sizes and sha256 (:meth:`local_cache`
included); a version removed under a reader (it was replaced, then collected) makes the reader resolve again.
Versions no manifest points to are removed by :meth:`ArtifactStore.gc` (and by every write, for its key) once
older than the grace period. A version written with ``stage=True`` keeps its manifest beside its files
(``<key>/.v/<version>/manifest.json``) and is read through its staged URI ``<uri>/.v/<version>`` until
:meth:`ArtifactStore.publish` makes it current (several artifacts at once, after checking every one is whole).
Manifests without ``version`` (written before versions existed) are still read: their files lie directly under
``<key>/``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import fsspec

from symfuse.errors import UsageError
from symfuse.io.modes import plain_mode
from symfuse.redact import install_log_redaction
from symfuse.store.errors import ArtifactNotFound, CorruptArtifact, IncompleteDownload, translated
from symfuse.store.hashing import matches_sha256
from symfuse.store.layout import MANIFEST, manifest_digest
from symfuse.store.s3 import option_secrets, s3_options
from symfuse.store.urls import store_url_problem
from symfuse.store.versions import VERSIONS, check_version, split_version_path, version_time

log = logging.getLogger(__name__)

DEFAULT_ROOT = "./symfuse-runs"
JSON_FILE = "data.json"


def default_root() -> str:
    """The store root when none is given: ``$SYMFUSE_STORE`` or ``./symfuse-runs``."""
    return os.environ.get("SYMFUSE_STORE") or DEFAULT_ROOT


def default_cache_dir() -> Path:
    """Where remote artifacts are downloaded: ``$SYMFUSE_CACHE`` or ``~/.cache/symfuse/artifacts``."""
    return Path(os.environ.get("SYMFUSE_CACHE") or Path.home() / ".cache" / "symfuse" / "artifacts")


class ArtifactReader:
    """The reading half of :class:`~symfuse.store.ArtifactStore` (keys, manifests, downloads, verification).

    Methods take a key (``runs/demo/models/isear``) or a full URI under this root (as returned by
    :meth:`uri` and :meth:`put_dir`), so tasks can pass URIs between each other.

    Args:
        root: Any fsspec URL or local path; default :func:`default_root`.
        cache_dir: Local folder for :meth:`local_cache` downloads; default :func:`default_cache_dir`.
        **storage_options: Passed to the filesystem (e.g. ``client_kwargs={"endpoint_url": ...}`` for s3fs; S3
            timeouts and attempts default to ``SYMFUSE_S3_TIMEOUT`` / ``SYMFUSE_S3_ATTEMPTS``, see
            :mod:`symfuse.store.s3`).

    Raises:
        ValueError: if ``SYMFUSE_S3_TIMEOUT`` / ``SYMFUSE_S3_ATTEMPTS`` hold no positive number.
        UsageError: the root's scheme is unknown or not installed, or it holds a credential (see
            :func:`~symfuse.store.urls.store_url_problem`).
    """

    def __init__(
        self, root: str | os.PathLike | None = None, cache_dir: str | os.PathLike | None = None, **storage_options
    ):
        root = str(root) if root is not None else default_root()
        problem = store_url_problem(root, "store root")
        if problem:
            raise UsageError(problem)
        protocol = fsspec.core.split_protocol(root)[0] or "file"
        self._hint = ""
        is_s3 = protocol in ("s3", "s3a")
        if is_s3:
            storage_options, limits, endpoint = s3_options(storage_options)
            self._hint = limits.hint(endpoint)
        elif protocol in ("file", "local"):
            storage_options.setdefault("auto_mkdir", True)
        install_log_redaction(*option_secrets(storage_options))
        with translated(f"store root {root}", self._hint):
            self.fs, path = fsspec.core.url_to_fs(root, **storage_options)
        if is_s3:
            self.fs.retries = 1  # s3fs's own retry loop; botocore's (config_kwargs) bounds the attempts
        self.path = path.rstrip("/") or path
        self._protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        self.is_local = "file" in self._protocols
        self.root = self.fs.unstrip_protocol(self.path).rstrip("/")
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.root!r})"

    def _io(self, what: str):
        """Backend errors about ``what`` become builtins (see :func:`symfuse.store.errors.translated`)."""
        return translated(what, self._hint)

    # ----------------------------------------------------------------------------------------------- keys
    def key(self, key_or_uri: str) -> str:
        """The key of a key or of a URI under this root (``s3://b/p/runs/x`` -> ``runs/x``).

        A staged URI (``<uri>/.v/<version>``, see :meth:`split_staged`) gives its artifact's key.

        Raises:
            ValueError: if it is a URI outside this root, or the key holds ``..`` or ``.v`` or is empty.
        """
        return self.split_staged(key_or_uri)[0]

    def split_staged(self, key_or_uri: str) -> tuple[str, str | None]:
        """``(key, version)`` of a staged URI ``<uri>/.v/<version>``, else ``(key, None)``.

        A staged URI names one version of an artifact written with ``stage=True``: it reads that version whatever
        the artifact's manifest names, until :meth:`ArtifactStore.publish` makes it the current one.

        Raises:
            ValueError: as :meth:`key`.
        """
        text = str(key_or_uri)
        if "://" in text:
            path = self.fs._strip_protocol(text).rstrip("/")
            base = self.fs._strip_protocol(self.path).rstrip("/")
            if fsspec.core.split_protocol(text)[0] not in self._protocols or not (
                path == base or path.startswith(base + "/")
            ):
                raise ValueError(f"{text!r} is not inside the store root {self.root!r}")
            text = path[len(base) :]
        key = text.strip("/")
        parts = key.split("/")
        version = None
        if len(parts) > 2 and parts[-2] == VERSIONS and version_time(parts[-1]) is not None:
            parts, version = parts[:-2], parts[-1]
            key = "/".join(parts)
        if not key or any(part in ("", ".", "..", VERSIONS) for part in parts):
            raise ValueError(f"artifact key {key_or_uri!r} is empty or holds '', '.', '..' or '{VERSIONS}' segments")
        return key, version

    def staged_uri(self, key: str, version: str) -> str:
        """The URI naming one version of an artifact: ``<uri>/.v/<version>`` (see :meth:`split_staged`)."""
        return f"{self.uri(key)}/{VERSIONS}/{check_version(version, self.uri(key))}"

    def _path(self, key: str, *rest: str) -> str:
        return "/".join([self.path, self.key(key), *rest])

    def _data_path(self, key: str, manifest: Mapping[str, Any], *rest: str) -> str:
        """Path of the manifest's data (``rest``: a file) -- its version folder, or the key (old manifests)."""
        if manifest.get("version") is None:
            return self._path(key, *rest)
        return self._path(key, VERSIONS, check_version(manifest["version"], self.uri(key)), *rest)

    def uri(self, key: str) -> str:
        """The full URI of an artifact (``s3://bucket/prefix/runs/...``, ``file:///...``, ``memory:///...``).

        Of a staged URI: its artifact's URI (what it is published as).
        """
        return f"{self.root}/{self.key(key)}"

    def file_uri(self, key: str, rel: str) -> str:
        """Full URI of one data file of the artifact's current version (for messages and low-level tools)."""
        return self.fs.unstrip_protocol(self._data_path(key, self.manifest(key), rel))

    # ----------------------------------------------------------------------------------------------- reading
    def exists(self, key: str, content_key: str | None = None) -> bool:
        """Whether a complete artifact is stored under ``key`` (its manifest is present).

        Args:
            key: Key or URI.
            content_key: When given, also require the manifest's ``content_key`` to equal it (the stage's inputs
                and config are unchanged, see :func:`symfuse.store.layout.content_key`).

        Raises:
            StoreUnreachable: (a ConnectionError) if the backend does not answer within the timeouts.
        """
        if self.split_staged(key)[1] is not None:
            try:
                staged = self.manifest(key)
            except ArtifactNotFound:
                return False
            return content_key is None or staged.get("content_key") == content_key
        with self._io(self.uri(key)):
            if not self.fs.exists(self._path(key, MANIFEST)):
                return False
        return content_key is None or self.manifest(key).get("content_key") == content_key

    def manifest(self, key: str) -> dict[str, Any]:
        """The artifact's manifest (of a staged URI: that version's, see :meth:`split_staged`).

        Raises:
            ArtifactNotFound: (a FileNotFoundError) if there is no manifest under ``key``.
            CorruptArtifact: if the manifest is not a valid manifest.
            OSError: for backend failures (ConnectionError, PermissionError, ...), cause kept.
        """
        if self.split_staged(key)[1] is not None:
            return self._staged_manifest(key)
        return self._read_manifest(key, self._path(key, MANIFEST))

    def _staged_manifest(self, staged: str) -> dict[str, Any]:
        """The manifest of one version: staged beside its files, or (published since) the artifact's own."""
        key, version = self.split_staged(staged)
        try:
            manifest = self._read_manifest(key, self._path(key, VERSIONS, version, MANIFEST))
        except ArtifactNotFound:
            try:
                manifest = self.manifest(key)
            except ArtifactNotFound:
                manifest = {}
            if manifest.get("version") != version:
                raise ArtifactNotFound(
                    f"no version {version} of {self.uri(key)}: it was never staged, or was replaced and collected"
                ) from None
        if manifest.get("version") != version:
            raise CorruptArtifact(f"{self.staged_uri(key, version)}/{MANIFEST} names another version; rewrite it")
        return manifest

    def _read_manifest(self, key: str, path: str) -> dict[str, Any]:
        try:
            with self._io(self.uri(key)):
                raw = self.fs.cat_file(path)
        except FileNotFoundError as exc:
            raise ArtifactNotFound(
                f"no artifact at {self.uri(key)} (no {MANIFEST}): it was never written or is still being written"
            ) from exc
        try:
            manifest = json.loads(raw)
        except ValueError as exc:
            raise CorruptArtifact(f"{self.uri(key)}/{MANIFEST} is not valid JSON; delete and recompute it") from exc
        if not isinstance(manifest, dict) or not all(isinstance(manifest.get(f), list | dict) for f in _REQUIRED):
            raise CorruptArtifact(f"{self.uri(key)}/{MANIFEST} lacks {'/'.join(_REQUIRED)}; delete and recompute it")
        return manifest

    def list(self, prefix: str = "") -> list[str]:
        """Keys of the complete artifacts under ``prefix`` (those with a manifest), sorted.

        Args:
            prefix: A key prefix such as ``runs/demo/models``; ``""`` lists the whole store.
        """
        base = self._path(prefix) if prefix.strip("/") else self.path
        with self._io(f"{self.root}/{prefix}"):
            if not self.fs.exists(base):
                return []
            found = self.fs.find(base)
        keys = []
        for path in found:
            rel = self._rel(path)
            if rel.endswith("/" + MANIFEST) and split_version_path(rel) is None:
                keys.append(rel[: -len(MANIFEST) - 1])
        return sorted(keys)

    def unmarked(self, prefix: str) -> list[str]:
        """Keys of the folders directly under ``prefix`` that hold files but are no artifact (no manifest), sorted.

        A checkpoint copied into ``runs/<run>/incoming`` by hand is such a folder: :meth:`list` does not see it.
        """
        base = self._path(prefix)
        with self._io(f"{self.root}/{prefix}"):
            if not self.fs.exists(base):
                return []
            children = [e["name"] for e in self.fs.ls(base, detail=True) if e.get("type") == "directory"]
            bare = [c for c in children if c.rstrip("/").rsplit("/", 1)[-1] != VERSIONS]
            return sorted(self._rel(c) for c in bare if not self.fs.exists(f"{c.rstrip('/')}/{MANIFEST}"))

    def folders(self, prefix: str) -> list[str]:
        """Names of the folders directly under ``prefix`` (artifacts or not; hidden ones left out), sorted.

        On an object store a folder is there while some object's key runs through it.
        """
        base = self._path(prefix)
        with self._io(f"{self.root}/{prefix}"):
            if not self.fs.isdir(base):
                return []
            entries = self.fs.ls(base, detail=True)
        names = (e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("type") == "directory")
        return sorted(n for n in names if not n.startswith("."))

    def _rel(self, path: str) -> str:
        """A backend path relative to the store root."""
        root = self.fs._strip_protocol(self.path).rstrip("/")
        return self.fs._strip_protocol(path)[len(root) :].strip("/")

    def _resolved(self, key: str, read: Callable[[dict[str, Any]], Any], attempts: int = 3) -> Any:
        """``read(manifest)``, again with the new manifest if the version vanished because another was published.

        A reader that resolved version A while a writer published B and collected A finds A's files gone; it is
        not damage, so it reads B. Missing files of the version the manifest still names are damage.
        """
        for attempt in range(attempts):
            manifest = self.manifest(key)
            try:
                return read(manifest)
            except (FileNotFoundError, CorruptArtifact) as exc:
                if isinstance(exc, ArtifactNotFound) or attempt == attempts - 1:
                    raise
                if self.manifest(key).get("version") == manifest.get("version"):
                    if isinstance(exc, CorruptArtifact):
                        raise
                    raise CorruptArtifact(
                        f"{self.uri(key)}: a file its manifest lists is missing ({exc}); the artifact is damaged: "
                        "delete and recompute it"
                    ) from exc
                log.info("%s was replaced while being read; reading the new version", self.uri(key))
        raise AssertionError("unreachable")  # pragma: no cover

    def get_dir(self, key: str, local_dir: str | os.PathLike) -> Path:
        """Download an artifact's files into ``local_dir`` and verify them against the manifest.

        Returns:
            ``local_dir``.

        Raises:
            ArtifactNotFound: (a FileNotFoundError) if the artifact has no manifest.
            CorruptArtifact: (an OSError) if a file is missing or its size or sha256 differs from the manifest.
        """
        out = Path(local_dir)
        self._resolved(key, lambda manifest: self._download(key, manifest, out))
        return out

    def _download(self, key: str, manifest: Mapping[str, Any], out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        for rel in manifest["files"]:
            dest = out / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            with self._io(f"{self.uri(key)}/{rel}"):
                self.fs.get_file(self._data_path(key, manifest, rel), str(dest))
            self._check_transfer(key, manifest, rel, dest)
        self._verify(key, out, manifest, sha=True)

    def _check_transfer(self, key: str, manifest: Mapping[str, Any], rel: str, dest: Path) -> None:
        """IncompleteDownload if ``dest`` lacks its size while the store's file has it (a damaged one: ``_verify``)."""
        want, got = manifest["sizes"][rel], dest.stat().st_size if dest.is_file() else 0
        if got != want:
            with self._io(f"{self.uri(key)}/{rel}"):
                whole = self.fs.size(self._data_path(key, manifest, rel)) == want
            if whole:
                cut = f"{got} of {want} bytes arrived while the store's file is whole — the transfer was cut; run again"
                raise IncompleteDownload(f"{self.uri(key)}/{rel}: {cut}")

    def local_cache(self, key: str, verify: bool = True) -> Path:
        """A local folder holding the artifact's files, downloaded at most once per content.

        Local stores return the current version's own folder (read it, never write into it). Remote artifacts land
        in ``cache_dir/<manifest digest>``, written atomically (so concurrent tasks may call this); a cached folder
        whose files no longer match the manifest is downloaded again.

        Args:
            key: Key or URI.
            verify: Check sizes and sha256 of every file against the manifest (``False``: sizes only).

        Raises:
            ArtifactNotFound: if the artifact has no manifest.
            CorruptArtifact: if a file of a local store (or a fresh download) does not match the manifest.
        """
        if self.is_local:
            return self._resolved(key, lambda manifest: self._local_folder(key, manifest, verify))
        return self._resolved(key, lambda manifest: self._cached_download(key, manifest, verify))

    def _local_folder(self, key: str, manifest: Mapping[str, Any], verify: bool) -> Path:
        folder = Path(self._data_path(key, manifest))
        self._verify(key, folder, manifest, sha=verify)
        return folder

    def _cached_download(self, key: str, manifest: Mapping[str, Any], verify: bool) -> Path:
        target = self.cache_dir / manifest_digest(manifest)
        for _ in range(3):
            if target.is_dir():
                try:
                    self._verify(key, target, manifest, sha=verify)
                    return target
                except CorruptArtifact as exc:
                    log.warning("cached copy %s does not match: %s; downloading it again", target, exc)
                    _discard(target)
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=self.cache_dir))
            try:
                self._download(key, manifest, tmp)
                plain_mode(tmp)  # mkdtemp made it 0700; a shared $SYMFUSE_CACHE is read by other users too
                try:
                    tmp.rename(target)
                    return target
                except OSError:
                    if not target.is_dir():  # a concurrent download won the race otherwise: verify that one
                        raise
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        raise IncompleteDownload(f"{self.uri(key)}: the cached copy {target} keeps changing; delete it and retry")

    def get_file(self, key: str, local_dir: str | os.PathLike | None = None) -> Path:
        """The local path of a one-file artifact (see :meth:`put_file`).

        Args:
            key: Key or URI.
            local_dir: Download there; default :meth:`local_cache`.

        Raises:
            ArtifactNotFound: if the artifact has no manifest.
            ValueError: if the artifact holds more than one file.
        """
        files = self.manifest(key)["files"]
        if len(files) != 1:
            raise ValueError(f"{self.uri(key)} holds {len(files)} files, not one: use get_dir or local_cache")
        folder = self.local_cache(key) if local_dir is None else self.get_dir(key, local_dir)
        return folder / files[0]

    def read_member(self, key: str, rel: str) -> bytes:
        """One data file of an artifact (of a staged URI: that version's), checked against the manifest's sha256.

        Reads that file alone (a model card beside a model's weights), not the whole artifact.

        Raises:
            ArtifactNotFound: the artifact has no manifest, or its manifest lists no ``rel``.
            CorruptArtifact: the file differs from the manifest.
        """

        def read(manifest: Mapping[str, Any]) -> bytes:
            if rel not in manifest["files"]:
                raise ArtifactNotFound(f"{self.uri(key)} holds no {rel} (its manifest lists {len(manifest['files'])})")
            with self._io(f"{self.uri(key)}/{rel}"):
                data = self.fs.cat_file(self._data_path(self.key(key), manifest, rel))
            if hashlib.sha256(data).hexdigest() != manifest["sha256"][rel]:
                raise CorruptArtifact(f"{self.uri(key)}/{rel}: sha256 differs from the manifest; recompute it")
            return data

        return self._resolved(key, read)

    def https_url(self, key: str, rel: str, expires_s: int = 7 * 24 * 3600) -> str | None:
        """A presigned https link to one data file of an artifact's version, where the backend signs (S3), else None.

        Args:
            key: Key, URI or staged URI (then that version's file).
            rel: The file inside the artifact.
            expires_s: Lifetime of the link (S3 allows at most 7 days).
        """
        try:
            return self.fs.sign(self._data_path(self.key(key), self.manifest(key), rel), expiration=expires_s)
        except NotImplementedError:
            return None

    def get_json(self, key: str) -> Any:
        """The object stored by :meth:`put_json`, verified against the manifest.

        Raises:
            ArtifactNotFound: if the artifact has no manifest.
            CorruptArtifact: if the bytes do not match the manifest.
        """

        def read(manifest: Mapping[str, Any]) -> Any:
            with self._io(f"{self.uri(key)}/{JSON_FILE}"):
                raw = self.fs.cat_file(self._data_path(key, manifest, JSON_FILE))
            if hashlib.sha256(raw).hexdigest() != manifest["sha256"].get(JSON_FILE):
                raise CorruptArtifact(f"{self.uri(key)}/{JSON_FILE}: sha256 differs from the manifest; rewrite it")
            return json.loads(raw)

        return self._resolved(key, read)

    def _verify(self, key: str, folder: Path, manifest: Mapping[str, Any], sha: bool) -> None:
        for rel in manifest["files"]:
            file = folder / rel
            if not file.is_file():
                raise CorruptArtifact(
                    f"{self.uri(key)}/{rel}: missing from {folder}; the artifact is damaged: delete and recompute it"
                )
            size = file.stat().st_size
            if size != manifest["sizes"][rel]:
                raise CorruptArtifact(
                    f"{self.uri(key)}/{rel}: {size} bytes, manifest says {manifest['sizes'][rel]}; "
                    "the artifact is damaged: delete and recompute it"
                )
            if sha and not matches_sha256(file, manifest["sha256"][rel]):
                raise CorruptArtifact(
                    f"{self.uri(key)}/{rel}: sha256 differs from the manifest; the artifact is damaged: "
                    "delete and recompute it"
                )


_REQUIRED = ("files", "sizes", "sha256")


def _discard(folder: Path) -> None:
    """Remove a cache folder this store made, moving it aside first (another process may be reading it)."""
    aside = folder.with_name(f".discard-{uuid.uuid4().hex[:8]}")
    try:
        folder.rename(aside)
    except OSError:
        return  # gone already (a concurrent reader discarded it)
    shutil.rmtree(aside, ignore_errors=True)
