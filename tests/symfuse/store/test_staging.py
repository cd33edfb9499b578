"""Staged versions: written whole but not current, read through their staged URI, published together or not at all."""

from __future__ import annotations

import pytest

from symfuse.store import ArtifactNotFound, ArtifactStore, CorruptArtifact

A, B = "runs/r/merged/simple/plain", "runs/r/report"


def folder(tmp_path, name: str, text: str):
    out = tmp_path / name
    out.mkdir()
    (out / "w.txt").write_text(text)
    return out


def test_staged_version_is_read_only_through_its_uri_until_published(store: ArtifactStore, tmp_path):
    store.put_dir(A, folder(tmp_path, "old", "old"), "test", content_key="old")
    staged = store.put_dir(A, folder(tmp_path, "new", "new"), "test", content_key="new", stage=True)
    key, version = store.split_staged(staged)
    assert key == A and staged == store.staged_uri(A, version) and store.uri(staged) == store.uri(A)
    assert (store.local_cache(A) / "w.txt").read_text() == "old"  # the current version is untouched
    assert store.manifest(A)["content_key"] == "old" and store.list("runs/r") == [A]
    assert (store.local_cache(staged) / "w.txt").read_text() == "new"
    assert store.exists(staged, "new") and not store.exists(staged, "old") and store.exists(A, "old")

    assert store.publish([staged]) == [store.uri(A)]
    assert (store.local_cache(A) / "w.txt").read_text() == "new"
    assert store.manifest(staged) == store.manifest(A)  # the staged URI still reads its version (current now)
    assert store.publish([staged, store.uri(A)]) == [store.uri(A)] * 2  # again: nothing moves
    assert store.manifest(A)["version"] == version


def test_publish_moves_nothing_if_one_staged_version_is_not_whole(store: ArtifactStore, tmp_path):
    store.put_dir(A, folder(tmp_path, "a0", "a0"), "test")
    store.put_json(B, {"v": 0}, "test")
    a = store.put_dir(A, folder(tmp_path, "a1", "a1"), "test", stage=True)
    b = store.put_json(B, {"v": 1}, "test", stage=True)
    _, version = store.split_staged(b)
    store.fs.rm_file(store._path(B, ".v", version, "data.json"))  # a file of the report's staged version lost
    with pytest.raises(CorruptArtifact, match="nothing was published"):
        store.publish([a, b])
    assert (store.local_cache(A) / "w.txt").read_text() == "a0" and store.get_json(B) == {"v": 0}

    gone = store.staged_uri(B, "20200101T000000000Z-0123456789abcdef")
    with pytest.raises(ArtifactNotFound, match="never staged"):
        store.publish([a, gone])
    assert (store.local_cache(A) / "w.txt").read_text() == "a0"
    assert not store.exists(gone)


def test_staged_uris_are_not_write_targets_and_not_listed(store: ArtifactStore, tmp_path):
    staged = store.put_json(B, {"v": 1}, "test", stage=True)
    assert store.list("runs") == [] and not store.exists(B)
    with pytest.raises(ValueError, match="names one version"):
        store.put_json(staged, {"v": 2}, "test")
    with pytest.raises(ValueError, match=r"'\.v'"):
        store.key(f"{B}/.v/not-a-version")
    assert store.get_json(staged) == {"v": 1}
    store.gc("runs", grace_s=0)  # an unpublished staged version is collected like any other
    assert not store.exists(staged)
