"""Artifacts in any fsspec filesystem: a local folder, ``s3://bucket/prefix`` (s3fs) or ``memory://`` in tests.

An artifact is a folder of files under a key (see :mod:`symfuse.store.layout`) plus ``manifest.json``
(``files``, ``sizes``, ``sha256``, ``producer``, ``inputs``, ``content_key``, ``created``). Data files are written
first and the manifest LAST, so an artifact without its manifest does not exist for readers; rewriting a key removes
the old manifest first. Readers verify sizes and sha256 against the manifest.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import fsspec

from symfuse.store.errors import ArtifactNotFound, CorruptArtifact, translated
from symfuse.store.layout import MANIFEST, manifest_digest

log = logging.getLogger(__name__)

DEFAULT_ROOT = "./symfuse-runs"
JSON_FILE = "data.json"
_CHUNK = 1 << 20


def default_root() -> str:
    """The store root when none is given: ``$SYMFUSE_STORE`` or ``./symfuse-runs``."""
    return os.environ.get("SYMFUSE_STORE") or DEFAULT_ROOT


def default_cache_dir() -> Path:
    """Where remote artifacts are downloaded: ``$SYMFUSE_CACHE`` or ``~/.cache/symfuse/artifacts``."""
    return Path(os.environ.get("SYMFUSE_CACHE") or Path.home() / ".cache" / "symfuse" / "artifacts")


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _s3_options(storage_options: dict[str, Any]) -> dict[str, Any]:
    """Defaults for s3fs: endpoint from ``AWS_ENDPOINT_URL`` and no listing cache (other processes write too)."""
    opts = dict(storage_options)
    opts.setdefault("use_listings_cache", False)
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    client_kwargs = dict(opts.get("client_kwargs") or {})
    if endpoint and "endpoint_url" not in client_kwargs and "endpoint_url" not in opts:
        client_kwargs["endpoint_url"] = endpoint
    if client_kwargs:
        opts["client_kwargs"] = client_kwargs
    return opts


class ArtifactStore:
    """Folders of files with a manifest, under one fsspec root.

    Methods take a key (``runs/demo/models/isear``) or a full URI under this root (as returned by
    :meth:`uri` and :meth:`put_dir`), so tasks can pass URIs between each other.

    Args:
        root: Any fsspec URL or local path; default :func:`default_root`.
        cache_dir: Local folder for :meth:`local_cache` downloads; default :func:`default_cache_dir`.
        **storage_options: Passed to the filesystem (e.g. ``client_kwargs={"endpoint_url": ...}`` for s3fs).
    """

    def __init__(
        self, root: str | os.PathLike | None = None, cache_dir: str | os.PathLike | None = None, **storage_options
    ):
        root = str(root) if root is not None else default_root()
        protocol = fsspec.core.split_protocol(root)[0] or "file"
        if protocol in ("s3", "s3a"):
            storage_options = _s3_options(storage_options)
        elif protocol in ("file", "local"):
            storage_options.setdefault("auto_mkdir", True)
        with translated(f"store root {root}"):
            self.fs, path = fsspec.core.url_to_fs(root, **storage_options)
        self.path = path.rstrip("/") or path
        self._protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        self.is_local = "file" in self._protocols
        self.root = self.fs.unstrip_protocol(self.path).rstrip("/")
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()

    def __repr__(self) -> str:
        return f"ArtifactStore({self.root!r})"

    # ----------------------------------------------------------------------------------------------- keys
    def key(self, key_or_uri: str) -> str:
        """The key of a key or of a URI under this root (``s3://b/p/runs/x`` -> ``runs/x``).

        Raises:
            ValueError: if it is a URI outside this root, or the key holds ``..`` or is empty.
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
        if not key or any(part in ("", ".", "..") for part in parts):
            raise ValueError(f"artifact key {key_or_uri!r} is empty or holds '', '.' or '..' segments")
        return key

    def _path(self, key: str, *rest: str) -> str:
        return "/".join([self.path, self.key(key), *rest])

    def uri(self, key: str) -> str:
        """The full URI of an artifact (``s3://bucket/prefix/runs/...``, ``file:///...``, ``memory:///...``)."""
        return f"{self.root}/{self.key(key)}"

    # ----------------------------------------------------------------------------------------------- reading
    def exists(self, key: str, content_key: str | None = None) -> bool:
        """Whether a complete artifact is stored under ``key`` (its manifest is present).

        Args:
            key: Key or URI.
            content_key: When given, also require the manifest's ``content_key`` to equal it (the stage's inputs
                and config are unchanged, see :func:`symfuse.store.layout.content_key`).
        """
        with translated(self.uri(key)):
            if not self.fs.exists(self._path(key, MANIFEST)):
                return False
        return content_key is None or self.manifest(key).get("content_key") == content_key

    def manifest(self, key: str) -> dict[str, Any]:
        """The artifact's manifest.

        Raises:
            ArtifactNotFound: (a FileNotFoundError) if there is no manifest under ``key``.
            OSError: for backend failures (ConnectionError, PermissionError, ...), cause kept.
        """
        path = self._path(key, MANIFEST)
        try:
            with translated(self.uri(key)):
                raw = self.fs.cat_file(path)
        except FileNotFoundError as exc:
            raise ArtifactNotFound(
                f"no artifact at {self.uri(key)} (no {MANIFEST}): it was never written or is still being written"
            ) from exc
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise CorruptArtifact(f"{self.uri(key)}/{MANIFEST} is not valid JSON; delete and recompute it") from exc

    def list(self, prefix: str = "") -> list[str]:
        """Keys of the complete artifacts under ``prefix`` (those with a manifest), sorted.

        Args:
            prefix: A key prefix such as ``runs/demo/models``; ``""`` lists the whole store.
        """
        base = self._path(prefix) if prefix.strip("/") else self.path
        with translated(f"{self.root}/{prefix}"):
            if not self.fs.exists(base):
                return []
            found = self.fs.find(base)
        keys = []
        root = self.fs._strip_protocol(self.path).rstrip("/")
        for path in found:
            path = self.fs._strip_protocol(path)
            if path.endswith("/" + MANIFEST):
                keys.append(path[len(root) :].strip("/")[: -len(MANIFEST) - 1])
        return sorted(keys)

    def get_dir(self, key: str, local_dir: str | os.PathLike) -> Path:
        """Download an artifact's files into ``local_dir`` and verify them against the manifest.

        Returns:
            ``local_dir``.

        Raises:
            ArtifactNotFound: (a FileNotFoundError) if the artifact has no manifest.
            CorruptArtifact: (an OSError) if a file's size or sha256 differs from the manifest.
        """
        manifest = self.manifest(key)
        out = Path(local_dir)
        out.mkdir(parents=True, exist_ok=True)
        for rel in manifest["files"]:
            dest = out / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            with translated(f"{self.uri(key)}/{rel}"):
                self.fs.get_file(self._path(key, rel), str(dest))
        self._verify(key, out, manifest, sha=True)
        return out

    def local_cache(self, key: str, verify: bool = True) -> Path:
        """A local folder holding the artifact's files, downloaded at most once per content.

        Local stores return the artifact's own folder (read it, never write into it). Remote artifacts land in
        ``cache_dir/<manifest digest>``, written atomically (so concurrent tasks may call this).

        Args:
            key: Key or URI.
            verify: Check sizes (local) or sizes and sha256 (fresh downloads) against the manifest.

        Raises:
            ArtifactNotFound: if the artifact has no manifest.
            CorruptArtifact: if a file does not match the manifest.
        """
        manifest = self.manifest(key)
        if self.is_local:
            folder = Path(self._path(key))
            if verify:
                self._verify(key, folder, manifest, sha=False)
            return folder
        target = self.cache_dir / manifest_digest(manifest)
        if target.is_dir():
            return target
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=self.cache_dir))
        try:
            self.get_dir(key, tmp)
            try:
                tmp.rename(target)
            except OSError:
                if not target.is_dir():  # a concurrent download won the race otherwise
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return target

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

    def get_json(self, key: str) -> Any:
        """The object stored by :meth:`put_json`, verified against the manifest.

        Raises:
            ArtifactNotFound: if the artifact has no manifest.
            CorruptArtifact: if the bytes do not match the manifest.
        """
        manifest = self.manifest(key)
        with translated(f"{self.uri(key)}/{JSON_FILE}"):
            raw = self.fs.cat_file(self._path(key, JSON_FILE))
        if hashlib.sha256(raw).hexdigest() != manifest["sha256"].get(JSON_FILE):
            raise CorruptArtifact(f"{self.uri(key)}/{JSON_FILE}: sha256 differs from the manifest; rewrite it")
        return json.loads(raw)

    def _verify(self, key: str, folder: Path, manifest: Mapping[str, Any], sha: bool) -> None:
        for rel in manifest["files"]:
            file = folder / rel
            size = file.stat().st_size if file.is_file() else -1
            if size != manifest["sizes"][rel]:
                raise CorruptArtifact(
                    f"{self.uri(key)}/{rel}: {size} bytes, manifest says {manifest['sizes'][rel]}; "
                    "the artifact is damaged: delete and recompute it"
                )
            if sha and _sha256_file(file) != manifest["sha256"][rel]:
                raise CorruptArtifact(
                    f"{self.uri(key)}/{rel}: sha256 differs from the manifest; the artifact is damaged: "
                    "delete and recompute it"
                )

    # ----------------------------------------------------------------------------------------------- writing
    def put_dir(
        self,
        key: str,
        local_dir: str | os.PathLike,
        producer: str,
        inputs: Mapping[str, str] | None = None,
        content_key: str | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> str:
        """Upload every file under ``local_dir`` as the artifact ``key``: data first, manifest last.

        Any artifact already under ``key`` is removed first (manifest before data), so readers never see a mix.
        A top-level ``manifest.json`` in ``local_dir`` is the store's own (``local_dir`` came from
        :meth:`local_cache` of a local store) and is not uploaded.

        Args:
            key: Key or URI.
            local_dir: Folder to upload (recursively; symlinks followed).
            producer: Who made it (task name, ``symfuse match``, ...).
            inputs: Name -> URI of the artifacts it was computed from.
            content_key: The stage's :func:`~symfuse.store.layout.content_key`, checked by :meth:`exists`.
            meta: Extra JSON-able facts to keep in the manifest.

        Returns:
            The artifact's URI.

        Raises:
            FileNotFoundError: if ``local_dir`` is not a folder.
        """
        src = Path(local_dir)
        if not src.is_dir():
            raise FileNotFoundError(f"cannot store {src} as {self.uri(key)}: not a folder")
        if self.is_local and src.resolve().is_relative_to(Path(self._path(key)).resolve()):
            raise ValueError(f"cannot store {src} as {self.uri(key)}: it is (inside) that artifact's own folder")
        files = sorted(p.relative_to(src).as_posix() for p in src.rglob("*") if p.is_file())
        if MANIFEST in files:  # src is itself an artifact (local_cache of a local store): its manifest is not data
            log.info("not uploading %s: %s is the store's own file", src / MANIFEST, MANIFEST)
            files = [f for f in files if f != MANIFEST and not (f.startswith(f".{MANIFEST}.") and f.endswith(".tmp"))]
        self.delete(key)
        sizes, sha = {}, {}
        for rel in files:
            sizes[rel] = (src / rel).stat().st_size
            sha[rel] = _sha256_file(src / rel)
            with translated(f"{self.uri(key)}/{rel}"):
                self.fs.put_file(str(src / rel), self._path(key, rel))
        return self._write_manifest(key, files, sizes, sha, producer, inputs, content_key, meta)

    def put_file(
        self,
        key: str,
        local_file: str | os.PathLike,
        producer: str,
        inputs: Mapping[str, str] | None = None,
        content_key: str | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> str:
        """Upload one file as the artifact ``key`` (a folder holding that file, under its own name).

        Returns:
            The artifact's URI; :meth:`get_file` gives the file back.
        """
        file = Path(local_file)
        if not file.is_file():
            raise FileNotFoundError(f"cannot store {file} as {self.uri(key)}: not a file")
        if file.name == MANIFEST:
            raise ValueError(f"{file}: the name {MANIFEST} is reserved for the store")
        self.delete(key)
        with translated(f"{self.uri(key)}/{file.name}"):
            self.fs.put_file(str(file), self._path(key, file.name))
        sizes, sha = {file.name: file.stat().st_size}, {file.name: _sha256_file(file)}
        return self._write_manifest(key, [file.name], sizes, sha, producer, inputs, content_key, meta)

    def put_json(
        self,
        key: str,
        obj: Any,
        producer: str,
        inputs: Mapping[str, str] | None = None,
        content_key: str | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> str:
        """Store a JSON-able object as the artifact ``key`` (one file, ``data.json``).

        Returns:
            The artifact's URI.
        """
        raw = json.dumps(obj, indent=1, sort_keys=True, default=str).encode()
        self.delete(key)
        with translated(f"{self.uri(key)}/{JSON_FILE}"):
            self.fs.pipe_file(self._path(key, JSON_FILE), raw)
        sizes, sha = {JSON_FILE: len(raw)}, {JSON_FILE: hashlib.sha256(raw).hexdigest()}
        return self._write_manifest(key, [JSON_FILE], sizes, sha, producer, inputs, content_key, meta)

    def _write_manifest(
        self,
        key: str,
        files: list[str],
        sizes: dict[str, int],
        sha: dict[str, str],
        producer: str,
        inputs: Mapping[str, str] | None,
        content_key: str | None,
        meta: Mapping[str, Any] | None,
    ) -> str:
        manifest = {
            "files": files,
            "sizes": sizes,
            "sha256": sha,
            "producer": producer,
            "inputs": dict(inputs or {}),
            "content_key": content_key,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "meta": dict(meta or {}),
        }
        raw = json.dumps(manifest, indent=1, sort_keys=True).encode()
        path = self._path(key, MANIFEST)
        with translated(f"{self.uri(key)}/{MANIFEST}"):
            if self.is_local:  # write + rename, so a reader never sees half a manifest
                tmp = Path(self._path(key, f".{MANIFEST}.{os.getpid()}.tmp"))
                tmp.parent.mkdir(parents=True, exist_ok=True)
                tmp.write_bytes(raw)
                os.replace(tmp, path)
            else:  # one PUT: object stores make it visible whole or not at all
                self.fs.pipe_file(path, raw)
        log.debug("stored %s (%d files) by %s", self.uri(key), len(files), producer)
        return self.uri(key)

    def delete(self, key: str) -> None:
        """Remove an artifact: its manifest first (so it stops existing at once), then its files.

        Deleting a key that holds nothing is not an error.
        """
        base = self._path(key)
        with translated(self.uri(key)):
            if self.fs.exists(f"{base}/{MANIFEST}"):
                self.fs.rm_file(f"{base}/{MANIFEST}")
            if self.fs.exists(base):
                self.fs.rm(base, recursive=True)
