"""Retention: a publish removes the once-current versions beyond ``keep_versions``, and nothing else."""

from __future__ import annotations

from pathlib import Path

import pytest

from symfuse.store import ArtifactStore
from symfuse.store.versions import new_version

KEY = "runs/r1/merged/ties/plain"


def versions_on_disk(root: Path) -> set[str]:
    return {p.name for p in (root / KEY / ".v").iterdir()}


def write(store: ArtifactStore, src: Path, payload: bytes, stage: bool = False) -> str:
    src.mkdir(exist_ok=True)
    (src / "model.safetensors").write_bytes(payload)
    uri = store.put_dir(KEY, src, "test", stage=stage)
    if stage:
        store.publish([uri])
    return store.manifest(KEY)["version"]


@pytest.mark.parametrize("keep", [1, 2, 3])
@pytest.mark.parametrize("stage", [False, True])
def test_publish_keeps_the_newest_versions_and_the_current_one_reads_back(tmp_path, keep, stage):
    root = tmp_path / "store"
    store = ArtifactStore(str(root), cache_dir=tmp_path / "cache", keep_versions=keep)
    written = [write(store, tmp_path / "src", bytes([i]) * 1000, stage) for i in range(5)]
    assert versions_on_disk(root) == set(written[-keep:])
    assert store.manifest(KEY)["previous"] == written[::-1][1:keep]  # newest first, the current one excluded
    assert (store.local_cache(KEY) / "model.safetensors").read_bytes() == bytes([4]) * 1000


def test_default_keeps_two_and_the_variable_sets_it(tmp_path, monkeypatch):
    monkeypatch.delenv("SYMFUSE_STORE_KEEP_VERSIONS", raising=False)
    assert ArtifactStore(str(tmp_path / "a")).keep_versions == 2
    monkeypatch.setenv("SYMFUSE_STORE_KEEP_VERSIONS", "1")
    root = tmp_path / "b"
    store = ArtifactStore(str(root))
    last = [write(store, tmp_path / "src", bytes([i])) for i in range(3)][-1]
    assert versions_on_disk(root) == {last}
    monkeypatch.setenv("SYMFUSE_STORE_KEEP_VERSIONS", "0")
    with pytest.raises(ValueError, match=r"^SYMFUSE_STORE_KEEP_VERSIONS='0' is not a whole number >= 1; set e\.g\."):
        ArtifactStore(str(root))
    with pytest.raises(ValueError, match="keep at least the current version"):
        ArtifactStore(str(root), keep_versions=0)


def test_retention_never_touches_what_was_never_current(tmp_path):
    """A writer's upload in progress (a version id no manifest named yet), a staged version and a foreign folder."""
    root = tmp_path / "store"
    store = ArtifactStore(str(root), cache_dir=tmp_path / "cache", keep_versions=1)
    write(store, tmp_path / "src", b"first")
    uploading = root / KEY / ".v" / new_version()
    uploading.mkdir()
    (uploading / "model.safetensors").write_bytes(b"half")
    foreign = root / KEY / ".v" / "notes"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    staged = store.put_dir(KEY, tmp_path / "src", "other writer", stage=True)
    last = [write(store, tmp_path / "src", bytes([i])) for i in range(3)][-1]
    assert versions_on_disk(root) == {last, uploading.name, "notes", store.split_staged(staged)[1]}
    assert (foreign / "keep.txt").read_text() == "mine" and (uploading / "model.safetensors").read_bytes() == b"half"


def test_retention_on_a_memory_store(tmp_path):
    store = ArtifactStore(f"memory://retention-{tmp_path.name}", cache_dir=tmp_path / "cache", keep_versions=1)
    for i in range(3):
        (tmp_path / "f.json").write_text(str(i))
        store.put_file(KEY, tmp_path / "f.json", "test")
    (only,) = store.fs.ls(store._path(KEY, ".v"), detail=False)
    assert only.rstrip("/").endswith(store.manifest(KEY)["version"])
