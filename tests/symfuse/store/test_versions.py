"""Versioned writes: concurrent writers never mix, a killed upload leaves the previous version, gc, cache checks."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import symfuse
from symfuse.store import ArtifactNotFound, ArtifactStore, CorruptArtifact
from tests.symfuse.store.conftest import make_store

KEY = "runs/r1/models/isear"
FILES = ("a.bin", "b.bin", "c.bin")
ROOT = Path(__file__).resolve().parents[3]


def writer_dir(folder: Path, tag: bytes, size: int = 4096) -> Path:
    """Three files of equal size per writer, so only sha256 tells two writers apart."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        (folder / name).write_bytes(tag * size)
    return folder


def read_files(folder: Path) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in FILES}


def version_dirs(store: ArtifactStore, key: str) -> set[str]:
    base = store._path(key, ".v")
    if not store.fs.exists(base):
        return set()
    return {p.rstrip("/").rsplit("/", 1)[-1] for p in store.fs.ls(base, detail=False)}


class Lockstep:
    """Lets named threads pass in a fixed order: ``order[i]`` runs its i-th step, then the next name may go."""

    def __init__(self, order: list[str]):
        self.order, self.step, self.cond = order, 0, threading.Condition()

    def run(self, fn, *args, **kwargs):
        name = threading.current_thread().name
        with self.cond:
            self.cond.wait_for(lambda: self.step >= len(self.order) or self.order[self.step] == name, timeout=30)
        try:
            return fn(*args, **kwargs)
        finally:
            with self.cond:
                self.step += 1
                self.cond.notify_all()


def test_concurrent_writers_publish_one_consistent_artifact(store: ArtifactStore, tmp_path, monkeypatch):
    sources = {"A": writer_dir(tmp_path / "A", b"A"), "B": writer_dir(tmp_path / "B", b"B")}
    # interleave the uploads file by file: A B | B A | A B -- the worst case for writers sharing one folder
    steps = Lockstep(["A", "B", "B", "A", "A", "B"])
    real_put = store.fs.put_file
    monkeypatch.setattr(store.fs, "put_file", lambda lpath, rpath, **kw: steps.run(real_put, lpath, rpath, **kw))
    errors = []

    def write(name: str) -> None:
        try:
            store.put_dir(KEY, sources[name], producer=f"writer-{name}")
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(n,), name=n) for n in sources]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors and not any(t.is_alive() for t in threads)
    winner = store.manifest(KEY)["producer"][-1]
    expected = read_files(sources[winner])
    assert read_files(store.get_dir(KEY, tmp_path / "out")) == expected  # get_dir verifies every sha256
    assert read_files(store.local_cache(KEY)) == expected
    assert store.manifest(KEY)["sha256"] == {n: hashlib.sha256(b).hexdigest() for n, b in expected.items()}
    assert store.list("runs") == [KEY]


def test_data_of_an_unpublished_version_is_not_readable(store: ArtifactStore, tmp_path):
    store.fs.pipe_file(store._path(KEY, ".v", "20260101T000000000Z-0123456789abcdef", "a.bin"), b"orphan")
    assert not store.exists(KEY)
    assert store.list("") == []
    with pytest.raises(ArtifactNotFound):
        store.get_dir(KEY, tmp_path / "out")
    removed = store.gc(grace_s=0)
    assert removed == [f"{store.uri(KEY)}/.v/20260101T000000000Z-0123456789abcdef"]
    assert version_dirs(store, KEY) == set()


def test_gc_keeps_published_young_and_foreign_versions(store: ArtifactStore, tmp_path, monkeypatch):
    store.put_dir(KEY, writer_dir(tmp_path / "v1", b"1"), producer="v1")
    v1 = store.manifest(KEY)["version"]
    store.fs.pipe_file(store._path(KEY, ".v", "not-a-version", "x"), b"someone else's")
    assert store.gc(grace_s=0) == []  # the published version and a folder symfuse did not name stay
    store.put_dir(KEY, writer_dir(tmp_path / "v2", b"2"), producer="v2")
    v2 = store.manifest(KEY)["version"]
    assert version_dirs(store, KEY) == {v1, v2, "not-a-version"}  # v1 is younger than the default grace
    assert store.gc(KEY) == []
    assert store.gc(KEY, grace_s=0) == [f"{store.uri(KEY)}/.v/{v1}"]
    assert version_dirs(store, KEY) == {v2, "not-a-version"}
    monkeypatch.setenv("SYMFUSE_STORE_GC_GRACE", "0")  # a later write collects the replaced version itself
    store.put_dir(KEY, writer_dir(tmp_path / "v3", b"3"), producer="v3")
    assert version_dirs(store, KEY) == {store.manifest(KEY)["version"], "not-a-version"}
    assert read_files(store.get_dir(KEY, tmp_path / "out")) == read_files(tmp_path / "v3")


def test_reader_of_a_replaced_and_collected_version_reads_the_new_one(store: ArtifactStore, tmp_path, monkeypatch):
    store.put_dir(KEY, writer_dir(tmp_path / "v1", b"1"), producer="v1")
    real_get = store.fs.get_file
    swapped = []

    def get_after_swap(rpath, lpath, **kwargs):
        if not swapped:  # between resolving v1 and reading it, v2 is published and v1 collected
            swapped.append(True)
            store.put_dir(KEY, writer_dir(tmp_path / "v2", b"2"), producer="v2")
            store.gc(KEY, grace_s=0)
        return real_get(rpath, lpath, **kwargs)

    monkeypatch.setattr(store.fs, "get_file", get_after_swap)
    assert read_files(store.get_dir(KEY, tmp_path / "out")) == read_files(tmp_path / "v2")


def test_old_layout_artifact_is_read_and_replaced(store: ArtifactStore, tmp_path):
    payload = b"legacy"
    manifest = {"files": ["m.bin"], "sizes": {"m.bin": 6}, "sha256": {"m.bin": hashlib.sha256(payload).hexdigest()}}
    store.fs.pipe_file(store._path(KEY, "m.bin"), payload)
    store.fs.pipe_file(store._path(KEY, "manifest.json"), json.dumps(manifest).encode())
    assert (store.local_cache(KEY) / "m.bin").read_bytes() == payload
    store.put_dir(KEY, writer_dir(tmp_path / "new", b"n"), producer="new")
    assert not store.fs.exists(store._path(KEY, "m.bin"))  # the replaced artifact's own file, listed by it
    assert read_files(store.get_dir(KEY, tmp_path / "out")) == read_files(tmp_path / "new")


def test_manifest_naming_a_bad_version_is_corrupt(store: ArtifactStore, tmp_path):
    store.put_dir(KEY, writer_dir(tmp_path / "v1", b"1"), producer="v1")
    manifest = store.manifest(KEY) | {"version": "../../../etc"}
    store.fs.pipe_file(store._path(KEY, "manifest.json"), json.dumps(manifest).encode())
    with pytest.raises(CorruptArtifact, match="not a symfuse version id"):
        store.get_dir(KEY, tmp_path / "out")


def test_tampered_cache_is_detected(store: ArtifactStore, tmp_path):
    src = writer_dir(tmp_path / "src", b"s")
    store.put_dir(KEY, src, producer="t")
    cached = store.local_cache(KEY)
    (cached / "b.bin").chmod(0o644)
    (cached / "b.bin").write_bytes(b"X" * 4096)  # same size, other bytes
    if store.is_local:  # the store's own files: refused, never rewritten by a reader
        with pytest.raises(CorruptArtifact, match=r"b\.bin: sha256"):
            store.local_cache(KEY)
        return
    again = store.local_cache(KEY)  # a cache is only a copy: downloaded again
    assert read_files(again) == read_files(src)


# --------------------------------------------------------------------------------------------------- kill test
WRITER = """
import json, sys, time
from pathlib import Path
from symfuse.store import ArtifactStore

root, key, src, marker, options = sys.argv[1:]
store = ArtifactStore(root, cache_dir=Path(marker).parent / "cache", **json.loads(options))
real_put, done = store.fs.put_file, []

def put_then_stall(lpath, rpath, **kwargs):
    real_put(lpath, rpath, **kwargs)
    done.append(rpath)
    if len(done) == 2:  # two of three files are up: tell the test, then hang until killed
        Path(marker).write_text("\\n".join(done))
        time.sleep(120)

store.fs.put_file = put_then_stall
store.put_dir(key, src, producer="killed")
"""


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_killed_upload_leaves_previous_version_and_gets_collected(backend, tmp_path, request, monkeypatch):
    store = make_store(backend, tmp_path, request)
    v1 = writer_dir(tmp_path / "v1", b"1")
    store.put_dir(KEY, v1, producer="v1")
    published = store.manifest(KEY)
    options = request.getfixturevalue("s3_server").storage_options if backend == "s3" else {}
    marker = tmp_path / "two-files-up"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(symfuse.__file__).parents[1]), str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-c", WRITER, store.root, KEY, str(writer_dir(tmp_path / "v2", b"2")), str(marker)]
    proc = subprocess.Popen([*cmd, json.dumps(options)], env=env)
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), f"the writer did not reach its second file (exit {proc.poll()})"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    assert proc.returncode == -signal.SIGKILL
    # the killed writer's files are there, but nobody can read them: the previous version is what readers get
    assert store.manifest(KEY) == published
    assert read_files(store.get_dir(KEY, tmp_path / "out")) == read_files(v1)
    assert read_files(store.local_cache(KEY)) == read_files(v1)
    assert store.list("runs") == [KEY]
    orphans = version_dirs(store, KEY) - {published["version"]}
    assert len(orphans) == 1 and all(store.fs.exists(p) for p in marker.read_text().splitlines())
    # the next run's gc: a young orphan may be a live writer, so only past the grace period
    assert store.gc("runs") == []
    assert store.gc("runs", grace_s=0) == [f"{store.uri(KEY)}/.v/{orphans.pop()}"]
    assert version_dirs(store, KEY) == {published["version"]}
    assert read_files(store.get_dir(KEY, tmp_path / "out2")) == read_files(v1)
