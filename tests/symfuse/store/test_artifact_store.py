"""Conformance suite of ArtifactStore, run on every backend (memory://, local folder, moto S3)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from symfuse.store import ArtifactNotFound, ArtifactStore, CorruptArtifact, IncompleteDownload, layout

KEY = "runs/r1/models/isear"


def make_dir(folder: Path, payload: bytes = b"weights" * 100) -> Path:
    """A small checkpoint-like folder with a nested file."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text('{"model_type": "bert"}')
    (folder / "model.safetensors").write_bytes(payload)
    (folder / "sub").mkdir(exist_ok=True)
    (folder / "sub" / "notes.txt").write_text("nested")
    return folder


def read_all(folder: Path) -> dict[str, bytes]:
    """Every file under a folder but the store's own manifest (present when a local store is read in place)."""
    files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
    files.pop("manifest.json", None)
    return files


def test_put_get_dir_round_trip(store: ArtifactStore, tmp_path):
    src = make_dir(tmp_path / "src")
    uri = store.put_dir(KEY, src, producer="finetune", inputs={"base": "minilm"}, content_key="abc")
    assert uri == store.uri(KEY)
    assert uri.startswith(store.root + "/") and uri.endswith(KEY)
    out = store.get_dir(uri, tmp_path / "out")  # the URI works wherever a key does
    assert read_all(out) == read_all(src)
    man = store.manifest(KEY)
    assert man["files"] == ["config.json", "model.safetensors", "sub/notes.txt"]
    assert man["sizes"]["model.safetensors"] == 700
    assert man["sha256"]["sub/notes.txt"] == hashlib.sha256(b"nested").hexdigest()
    assert (man["producer"], man["inputs"], man["content_key"]) == ("finetune", {"base": "minilm"}, "abc")
    assert man["created"].endswith("Z")


def test_exists_only_with_manifest_and_matching_content_key(store: ArtifactStore, tmp_path):
    assert not store.exists(KEY)
    store.put_dir(KEY, make_dir(tmp_path / "src"), producer="t", content_key="k1")
    assert store.exists(KEY)
    assert store.exists(store.uri(KEY))
    assert store.exists(KEY, content_key="k1")
    assert not store.exists(KEY, content_key="k2")


def test_data_without_manifest_does_not_exist(store: ArtifactStore, tmp_path):
    # a writer that died after its data files, before its manifest
    store.fs.pipe_file(store._path(KEY, "model.safetensors"), b"partial")
    assert not store.exists(KEY)
    assert store.list("runs") == []
    with pytest.raises(FileNotFoundError, match="runs/r1/models/isear") as info:
        store.get_dir(KEY, tmp_path / "out")
    assert isinstance(info.value, ArtifactNotFound)
    assert info.value.__cause__ is not None
    with pytest.raises(ArtifactNotFound):
        store.manifest(KEY)
    with pytest.raises(ArtifactNotFound):
        store.local_cache(KEY)


def data_path(store: ArtifactStore, key: str, rel: str) -> str:
    """Backend path of one data file of the artifact's current version."""
    return store._data_path(key, store.manifest(key), rel)


def test_sha256_catches_same_size_corruption(store: ArtifactStore, tmp_path):
    store.put_dir(KEY, make_dir(tmp_path / "src"), producer="t")
    store.fs.pipe_file(data_path(store, KEY, "model.safetensors"), b"X" * 700)  # same size, other bytes
    with pytest.raises(CorruptArtifact, match=r"model\.safetensors: sha256"):
        store.get_dir(KEY, tmp_path / "out")


def test_local_cache_hashes_an_unchanged_file_once_and_a_rewritten_one_again(tmp_path, monkeypatch):
    import os
    import time

    from symfuse.io import memo
    from symfuse.store import hashing

    settle = 1.0  # long enough that a busy CI machine still reads twice before the files settle
    monkeypatch.setattr(memo, "SETTLED_NS", int(settle * 1e9))
    monkeypatch.setattr(memo, "FINE_SETTLED_NS", int(settle * 1e9))
    store = ArtifactStore(str(tmp_path / "root"))
    store.put_dir(KEY, make_dir(tmp_path / "src"), producer="t")
    hashed = []
    real = hashing.sha256_file
    monkeypatch.setattr(hashing, "sha256_file", lambda path: hashed.append(Path(path).name) or real(path))
    folder = store.local_cache(KEY)
    first = len(hashed)
    assert first >= 1 and store.local_cache(KEY) == folder
    assert len(hashed) == 2 * first  # just written: hashed every time (a rewrite could keep its times)
    time.sleep(settle + 0.05)
    store.local_cache(KEY)
    assert len(hashed) == 3 * first  # settled: hashed once more, then remembered
    assert store.local_cache(KEY) == folder and len(hashed) == 3 * first  # verified digests remembered
    target = data_path(store, KEY, "model.safetensors")
    stat = os.stat(target)
    store.fs.pipe_file(target, b"X" * stat.st_size)  # same size, other bytes, written in place
    os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # (coarse clocks: a later mtime)
    with pytest.raises(CorruptArtifact, match=r"model\.safetensors: sha256"):
        store.local_cache(KEY)


def test_size_check_catches_truncation_in_local_cache(store: ArtifactStore, tmp_path):
    store.put_dir(KEY, make_dir(tmp_path / "src"), producer="t")
    store.fs.pipe_file(data_path(store, KEY, "model.safetensors"), b"short")
    with pytest.raises(CorruptArtifact, match=r"model\.safetensors"):
        store.local_cache(KEY)
    assert isinstance(CorruptArtifact("x"), OSError)


def test_a_cut_download_is_told_apart_from_a_damaged_store_file(store: ArtifactStore, tmp_path, monkeypatch):
    store.put_dir(KEY, make_dir(tmp_path / "src"), producer="t")
    get_file = store.fs.get_file

    def cut(remote, local, **kw):  # the connection drops after 3 bytes of the weights
        get_file(remote, local, **kw)
        if str(local).endswith("model.safetensors"):
            Path(local).write_bytes(Path(local).read_bytes()[:3])

    with monkeypatch.context() as m:
        m.setattr(store.fs, "get_file", cut)
        with pytest.raises(IncompleteDownload, match=r"model\.safetensors: 3 of 700 bytes arrived"):
            store.get_dir(KEY, tmp_path / "cut")
    assert read_all(store.get_dir(KEY, tmp_path / "again")) == read_all(tmp_path / "src")  # retrying helps
    store.fs.pipe_file(data_path(store, KEY, "model.safetensors"), b"short")  # the store's own file is damaged
    with pytest.raises(CorruptArtifact, match=r"model\.safetensors: 5 bytes, manifest says 700") as info:
        store.get_dir(KEY, tmp_path / "damaged")
    assert not isinstance(info.value, IncompleteDownload)


def test_rewrite_keeps_old_version_readable_during_upload(store: ArtifactStore, tmp_path, monkeypatch):
    v1 = make_dir(tmp_path / "v1")
    store.put_dir(KEY, v1, producer="t")
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "only.bin").write_bytes(b"v2")
    seen = []
    real_put = store.fs.put_file

    def spy(lpath, rpath, **kwargs):
        # what a concurrent reader sees mid-upload: the previous version, whole and verified
        seen.append((store.manifest(KEY)["producer"], read_all(store.get_dir(KEY, tmp_path / f"mid{len(seen)}"))))
        return real_put(lpath, rpath, **kwargs)

    monkeypatch.setattr(store.fs, "put_file", spy)
    store.put_dir(KEY, v2, producer="t2")
    assert seen == [("t", read_all(v1))]
    assert store.manifest(KEY)["files"] == ["only.bin"]
    assert read_all(store.get_dir(KEY, tmp_path / "out")) == {"only.bin": b"v2"}


def test_put_file_get_file(store: ArtifactStore, tmp_path):
    file = tmp_path / "L00.attn.safetensors"
    file.write_bytes(b"\x00\x01transform")
    key = layout.transform_key("r1", "isear", "L00.attn")
    store.put_file(key, file, producer="match")
    got = store.get_file(key)
    assert got.name == file.name and got.read_bytes() == file.read_bytes()
    got2 = store.get_file(key, tmp_path / "dl")
    assert got2 == tmp_path / "dl" / file.name and got2.read_bytes() == file.read_bytes()
    store.put_dir("runs/r1/two", make_dir(tmp_path / "src"), producer="t")
    with pytest.raises(ValueError, match="3 files"):
        store.get_file("runs/r1/two")


def test_move_gives_the_files_away_only_where_a_rename_can(store: ArtifactStore, tmp_path):
    import os
    import stat

    src = make_dir(tmp_path / "scratch")
    (src / "model.safetensors").chmod(0o600)  # a scratch file made by mkstemp: private
    (src / "link.txt").symlink_to(src / "config.json")  # a symlink is never moved (its target is not the caller's)
    expected = read_all(src)
    uri = store.put_dir(KEY, src, producer="merge", move=True)
    assert read_all(store.get_dir(uri, tmp_path / "out")) == expected
    digest = hashlib.sha256(expected["model.safetensors"]).hexdigest()
    assert store.manifest(KEY)["sha256"]["model.safetensors"] == digest
    left = {p.relative_to(src).as_posix() for p in src.rglob("*") if p.is_file() and not p.is_symlink()}
    if store.is_local:  # renamed into the version: gone from the scratch folder, readable as a copy would be
        assert left == set() and (src / "link.txt").is_symlink()
        stored = store.local_cache(uri)
        mask = os.umask(0o022)
        os.umask(mask)
        assert stat.S_IMODE((stored / "model.safetensors").stat().st_mode) == 0o666 & ~mask
        assert not (stored / "link.txt").is_symlink() and (stored / "link.txt").read_bytes() == expected["config.json"]
    else:  # memory:// and S3 copy: the caller keeps its files
        assert left == {"config.json", "model.safetensors", "sub/notes.txt"}
    one = tmp_path / "one.bin"
    one.write_bytes(b"x" * 1000)
    file_uri = store.put_file("runs/r1/stats/x", one, producer="collect_stats", move=True)
    assert one.exists() is not store.is_local
    assert Path(store.get_file(file_uri, tmp_path / "got")).read_bytes() == b"x" * 1000


def test_put_get_json(store: ArtifactStore):
    key = layout.eval_key("r1", "simple-plain", "isear")
    store.put_json(key, {"accuracy": 0.5, "n": 3}, producer="evaluate", inputs={"model": "x"})
    assert store.get_json(key) == {"accuracy": 0.5, "n": 3}
    store.fs.pipe_file(data_path(store, key, "data.json"), json.dumps({"accuracy": 0.9}).encode())
    with pytest.raises(CorruptArtifact):
        store.get_json(key)


def test_list_shows_only_complete_artifacts(store: ArtifactStore, tmp_path):
    src = make_dir(tmp_path / "src")
    for ds in ("meld", "isear"):
        store.put_dir(layout.model_key("r1", ds), src, producer="t")
    store.put_json(layout.eval_key("r1", "simple-plain", "meld"), {"a": 1}, producer="t")
    store.fs.pipe_file(store._path("runs/r1/models/half", "model.safetensors"), b"no manifest yet")
    assert store.list(layout.models_prefix("r1")) == ["runs/r1/models/isear", "runs/r1/models/meld"]
    assert store.list("runs/r1") == [
        "runs/r1/eval/simple-plain/meld",
        "runs/r1/models/isear",
        "runs/r1/models/meld",
    ]
    assert store.list("") == store.list("runs")
    assert store.list("runs/nothing-here") == []


def test_folders_are_the_runs_with_or_without_artifacts(store: ArtifactStore, tmp_path):
    assert store.folders(layout.runs_prefix()) == []  # a new store: no runs/ yet
    store.put_json(layout.eval_key("r2", "simple-plain", "meld"), {"a": 1}, producer="t")
    store.put_dir(layout.incoming_key("r1", "m"), make_dir(tmp_path / "src"), producer="t")
    store.fs.pipe_file(store._path("runs/r3/incoming/copied", "model.safetensors"), b"no manifest")
    assert store.folders(layout.runs_prefix()) == ["r1", "r2", "r3"]
    assert store.folders(layout.incoming_prefix("r1")) == ["m"]
    assert store.folders(layout.incoming_key("r1", "m")) == []  # its versions folder (.v) is left out


def test_delete(store: ArtifactStore, tmp_path):
    store.put_dir(KEY, make_dir(tmp_path / "src"), producer="t")
    data = data_path(store, KEY, "model.safetensors")
    assert store.fs.exists(data)
    store.delete(KEY)
    assert not store.exists(KEY)
    assert store.list("runs") == []
    assert not store.fs.exists(data)
    assert not store.fs.exists(store._path(KEY))
    store.delete(KEY)  # nothing there: no error


def test_local_cache_downloads_once_per_content(store: ArtifactStore, tmp_path):
    store.put_dir(KEY, make_dir(tmp_path / "src"), producer="t")
    first = store.local_cache(KEY)
    assert read_all(first) == read_all(tmp_path / "src")
    assert store.local_cache(KEY) == first
    if store.is_local:
        assert first == Path(data_path(store, KEY, "x")).parent  # local stores are read in place
        return
    assert first.parent == store.cache_dir
    (first / "marker").write_text("cached")  # a second call does not download again
    assert (store.local_cache(KEY) / "marker").exists()
    store.put_dir(KEY, make_dir(tmp_path / "src2", payload=b"other"), producer="t")
    second = store.local_cache(KEY)
    assert second != first
    assert (second / "model.safetensors").read_bytes() == b"other"


def test_keys_are_checked(store: ArtifactStore, tmp_path):
    for bad in ("", "runs/../etc", "runs//x", "/"):
        with pytest.raises(ValueError, match="artifact key"):
            store.uri(bad)
    with pytest.raises(ValueError, match="not inside the store root"):
        store.key("s3://elsewhere/runs/x" if not store.root.startswith("s3://") else "memory://elsewhere/x")
    assert store.key(store.uri(KEY)) == KEY
    assert store.key("/" + KEY + "/") == KEY
    with pytest.raises(FileNotFoundError, match="not a folder"):
        store.put_dir(KEY, tmp_path / "absent", producer="t")
    with pytest.raises(FileNotFoundError, match="not a file"):
        store.put_file(KEY, tmp_path / "absent.bin", producer="t")


def test_copy_artifact_through_local_cache(store: ArtifactStore, tmp_path):
    # e.g. a user-brought checkpoint re-stored under the run's model key
    store.put_dir(KEY, make_dir(tmp_path / "src"), producer="user")
    copy = layout.model_key("r2", "isear")
    store.put_dir(copy, store.local_cache(KEY), producer="import", inputs={"source": store.uri(KEY)})
    assert store.manifest(copy)["files"] == store.manifest(KEY)["files"]
    assert layout.manifest_digest(store.manifest(copy)) == layout.manifest_digest(store.manifest(KEY))


def test_default_root_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("SYMFUSE_STORE", str(tmp_path / "env-store"))
    store = ArtifactStore()
    assert store.root == f"file://{tmp_path / 'env-store'}"
    monkeypatch.delenv("SYMFUSE_STORE")
    monkeypatch.chdir(tmp_path)
    assert ArtifactStore().root == f"file://{tmp_path / 'symfuse-runs'}"


def test_s3_endpoint_from_aws_env(monkeypatch, s3_server, s3_bucket, tmp_path):
    # what a worker process sees: only AWS_* variables, no storage options
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    store = ArtifactStore(f"s3://{s3_bucket}/from-env", cache_dir=tmp_path / "cache")
    store.put_json("runs/r/report", {"ok": True}, producer="t")
    assert store.get_json(store.uri("runs/r/report")) == {"ok": True}


def test_damaged_manifest_is_a_corrupt_artifact(store: ArtifactStore, tmp_path):
    store.put_dir(KEY, make_dir(tmp_path / "src"), producer="t")
    store.fs.pipe_file(store._path(KEY, "manifest.json"), b'{"files": [')
    with pytest.raises(CorruptArtifact, match=r"manifest\.json") as info:
        store.get_dir(KEY, tmp_path / "out")
    assert isinstance(info.value.__cause__, ValueError)


def test_rewriting_an_artifact_from_its_own_folder_is_refused(tmp_path):
    store = ArtifactStore(tmp_path / "store", cache_dir=tmp_path / "cache")
    store.put_dir(KEY, make_dir(tmp_path / "src"), producer="t")
    with pytest.raises(ValueError, match="own folder"):
        store.put_dir(KEY, store.local_cache(KEY), producer="t")
    assert store.exists(KEY)  # nothing was deleted


def test_read_member_reads_one_file_of_a_version_and_checks_it(store: ArtifactStore, tmp_path):
    store.put_dir(KEY, make_dir(tmp_path / "v1"), producer="finetune", inputs={}, content_key="1")
    src = make_dir(tmp_path / "v2")
    (src / "sub" / "notes.txt").write_text("staged notes")
    staged = store.put_dir(KEY, src, producer="finetune", inputs={}, content_key="2", stage=True)
    assert store.read_member(KEY, "sub/notes.txt") == b"nested"  # the published version
    assert store.read_member(staged, "sub/notes.txt") == b"staged notes"  # the version a staged URI names
    with pytest.raises(ArtifactNotFound, match=r"holds no README\.md"):
        store.read_member(KEY, "README.md")


def test_https_url_is_a_presigned_link_where_the_backend_signs(store: ArtifactStore, tmp_path):
    import urllib.request

    store.put_dir(KEY, make_dir(tmp_path / "src"), producer="finetune", inputs={}, content_key="1")
    url = store.https_url(KEY, "sub/notes.txt")
    if not store.root.startswith("s3://"):
        assert url is None  # a local folder or memory:// has no link a browser opens
        return
    assert url.startswith("http") and "Signature" in url
    with urllib.request.urlopen(url, timeout=10) as response:  # no credentials: the signature is the permission
        assert response.read() == b"nested"
