"""symfuse.io: bad safetensors files, dtypes and NaN / inf are refused up front; writes are atomic and name the file."""

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from symfuse.checkpoint import CheckpointReader, write_checkpoint
from symfuse.errors import CheckpointError, NonFiniteError
from symfuse.io import TensorFile, check_finite, read_header, save_safetensors
from symfuse.merge import merge_checkpoints
from symfuse.stats import StatsFile
from tests.tiny import save_tiny

QUERY = "encoder.layer.0.attention.self.query.weight"


def _rewrite_header(file, edit):
    """Rewrite a safetensors header with ``edit(header dict)``, keeping the data bytes."""
    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    blob = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + n :])


def _lie_shape(h):
    h[QUERY]["shape"] = [64, 32]  # twice the bytes its offsets span


def _lie_offsets(h):
    h[QUERY]["data_offsets"][1] += 10**9  # past the end of the file


def _overlap(h):
    other = next(k for k in h if k not in ("__metadata__", QUERY) and h[k]["shape"] == h[QUERY]["shape"])
    h[other]["data_offsets"] = list(h[QUERY]["data_offsets"])


def _bad_dtype(h):
    h[QUERY]["dtype"] = "F13"


def _damage(file, how):
    if how == "truncated":
        data = file.read_bytes()
        file.write_bytes(data[: len(data) // 2])
    elif how == "garbage":
        file.write_bytes(os.urandom(4096))
    elif how == "empty":
        file.write_bytes(b"")
    elif how == "json":
        file.write_bytes(struct.pack("<Q", 12) + b"{not json!!}" + b"\0" * 64)
    else:
        _rewrite_header(
            file, {"shape": _lie_shape, "offsets": _lie_offsets, "overlap": _overlap, "dtype": _bad_dtype}[how]
        )


BAD = ["truncated", "garbage", "empty", "json", "shape", "offsets", "overlap", "dtype"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny") / "m", "bert", seed=0)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("how", BAD)
def test_bad_safetensors_is_a_checkpoint_error_naming_the_file(tiny, tmp_path, how):
    folder = _copy(tiny, tmp_path / "bad")
    file = folder / "model.safetensors"
    _damage(file, how)
    with pytest.raises(CheckpointError, match=r"model\.safetensors") as err:
        CheckpointReader(folder)
    msg = str(err.value)
    assert str(file) in msg and "\n" not in msg and " — " in msg
    with pytest.raises(CheckpointError):
        read_header(file)


@pytest.mark.parametrize(("command", "how"), [("match", "truncated"), ("match", "empty"), ("merge", "shape")])
def test_bad_safetensors_on_the_command_line_exits_nonzero_without_traceback(tiny, tmp_path, how, command):
    folder = _copy(tiny, tmp_path / "bad")
    _damage(folder / "model.safetensors", how)
    if command == "match":
        args = ["match", str(folder), str(tiny), "--out", str(tmp_path / "out")]
    else:
        args = ["merge", "--strategy", "simple", "--models", str(tiny), str(folder), "--out", str(tmp_path / "out")]
    code = "import sys; from symfuse.cli import main; sys.argv = ['symfuse'] + sys.argv[1:]; main()"
    res = subprocess.run([sys.executable, "-c", code, *args], check=False, capture_output=True, text=True, timeout=300)
    assert res.returncode != 0
    assert not (tmp_path / "out").exists()
    if command == "match":  # the merge command's one-line error boundary belongs to the CLI work
        assert "Traceback" not in res.stderr and "model.safetensors" in res.stderr, res.stderr
    with pytest.raises(CheckpointError, match=str(folder / "model.safetensors")):
        merge_checkpoints("simple", [tiny, folder], tmp_path / "out2")
    assert not (tmp_path / "out2").exists()


def test_integer_tensors_are_never_transformed(tiny, tmp_path):
    from symfuse.match import disguise_checkpoint

    sd = load_file(str(tiny / "model.safetensors"))
    folder = _copy(tiny, tmp_path / "int")
    save_file({**sd, QUERY: sd[QUERY].to(torch.int32)}, str(folder / "model.safetensors"), {"format": "pt"})
    with pytest.raises(CheckpointError, match=r"torch\.int32"):
        disguise_checkpoint(folder, tmp_path / "rotated", seed=0)
    assert not (tmp_path / "rotated").exists()
    # an integer tensor outside every module passes through a transform untouched; changing it is refused
    counter = torch.arange(7, dtype=torch.int32)
    folder2 = _copy(tiny, tmp_path / "extra")
    save_file({**sd, "extra.counter": counter}, str(folder2 / "model.safetensors"), {"format": "pt"})
    out = disguise_checkpoint(folder2, tmp_path / "d2", seed=0)
    got = load_file(str(tmp_path / "d2" / "model.safetensors"))
    assert out is not None and torch.equal(got["extra.counter"], counter)
    assert not torch.equal(got[QUERY], sd[QUERY])  # the float weights really were transformed
    with CheckpointReader(folder2) as r, pytest.raises(CheckpointError, match="never transformed"):
        write_checkpoint(r, tmp_path / "w", replace=lambda n, t: t * 2 if n == "extra.counter" else t)
    assert not (tmp_path / "w").exists()


def test_streamed_finite_check_names_file_and_tensor(tiny, tmp_path):
    sd = load_file(str(tiny / "model.safetensors"))
    name = "embeddings.word_embeddings.weight"  # (64, 32): checked in several chunks below
    sd[name][50, 3] = float("inf")
    file = tmp_path / "w.safetensors"
    save_file(sd, str(file))
    with TensorFile(file) as tf, pytest.raises(NonFiniteError, match=name) as err:
        check_finite([tf], chunk_bytes=1024)
    assert str(file) in str(err.value)
    with TensorFile(tiny / "model.safetensors") as tf:
        check_finite([tf], chunk_bytes=1024)  # a finite file passes


def test_a_file_found_finite_is_not_read_again_until_it_changes(tiny, tmp_path, monkeypatch):
    import os
    import time

    from symfuse.io import folder, memo

    settle = 1.0  # long enough that a busy CI machine still checks twice before it settles
    monkeypatch.setattr(memo, "SETTLED_NS", int(settle * 1e9))
    monkeypatch.setattr(memo, "FINE_SETTLED_NS", int(settle * 1e9))
    reads = []
    real = folder.check_finite_tensor
    monkeypatch.setattr(folder, "check_finite_tensor", lambda t, n, w: reads.append(n) or real(t, n, w))
    sd = load_file(str(tiny / "model.safetensors"))
    file = tmp_path / "w.safetensors"
    save_file(sd, str(file))

    def check() -> int:
        reads.clear()
        with TensorFile(file) as tf:
            check_finite([tf])
        return len(reads)

    assert check() == len(sd) and check() == len(sd)  # just written: read every time (a rewrite could keep its times)
    time.sleep(settle + 0.05)
    assert check() == len(sd)  # settled: read once more, then remembered
    assert check() == 0
    with TensorFile(file) as tf:
        check_finite([tf], names=[QUERY])  # a check of some tensors only is never skipped
    assert reads == [QUERY]
    mtime = file.stat().st_mtime_ns
    sd[QUERY][0, 0] = float("nan")  # rewritten, the same size: its times move, so it is read again
    save_file(sd, str(file))
    with pytest.raises(NonFiniteError, match=QUERY):
        check()
    time.sleep(settle + 0.05)
    os.utime(file, ns=(mtime, mtime))  # the remembered mtime set back: the ctime still moved, the NaN is found
    with pytest.raises(NonFiniteError, match=QUERY):
        check()


def test_save_safetensors_is_atomic(tmp_path, monkeypatch):
    file = tmp_path / "s.safetensors"
    save_safetensors({"a": torch.ones(3)}, file, {"kind": "gram"})
    import symfuse.io.safetensors as st

    def half_write(tensors, path, metadata=None):
        with open(path, "wb") as fh:
            fh.write(b"\x10\x00\x00")
        raise OSError("disk full")

    monkeypatch.setattr(st, "save_file", half_write)
    with pytest.raises(OSError, match="disk full"):
        save_safetensors({"a": torch.zeros(3)}, file, {"kind": "gram"})
    assert [p.name for p in tmp_path.iterdir()] == ["s.safetensors"]  # no temporary file left
    assert torch.equal(StatsFile(file).get("a"), torch.ones(3))  # the previous version is intact


def test_a_full_disk_names_the_file_and_leaves_the_old_version(tmp_path, monkeypatch):
    """safetensors' own I/O error (no file, no errno) becomes an OSError naming the file; nothing half-written."""
    import errno

    from safetensors import SafetensorError

    import symfuse.io.safetensors as st

    target = save_safetensors({"w": torch.ones(2)}, tmp_path / "model.safetensors")

    def full(tensors, path, metadata=None):
        Path(path).write_bytes(b"partial")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(st, "save_file", full)
    with pytest.raises(OSError, match=r"model\.safetensors: could not be written .* free disk space") as info:
        save_safetensors({"w": torch.zeros(2)}, target)
    assert info.value.errno == errno.ENOSPC
    assert torch.equal(load_file(target)["w"], torch.ones(2))  # the previous version, still readable
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]  # no temporary left


@pytest.mark.parametrize("shard_bytes", [2 * 1024**3, 8 * 1024])
def test_write_checkpoint_streams_the_bytes_save_file_writes(tiny, tmp_path, shard_bytes):
    """Each tensor goes to its planned offset as it comes: same files, bytes, shard split and index as save_file."""
    sd = load_file(str(tiny / "model.safetensors"))
    seen = []

    def double(name, t):
        seen.append(name)
        return t * 2 if t.is_floating_point() else t

    with CheckpointReader(tiny) as r:
        names = list(r.names())
        out = write_checkpoint(r, tmp_path / "out", replace=double, shard_bytes=shard_bytes, extra_files={"x": b"1"})
    assert seen == names  # storage order, one call per tensor
    want = {n: (t * 2 if t.is_floating_point() else t) for n, t in sd.items()}
    files = sorted(p.name for p in out.glob("*.safetensors"))
    if shard_bytes > 1024**2:
        assert files == ["model.safetensors"]
        save_file(want, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
        assert (out / "model.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    else:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert len(files) > 2 and sorted(set(index["weight_map"].values())) == files
        assert index["metadata"]["total_size"] == sum((out / f).stat().st_size for f in files)
        for f in files:  # each shard is what save_file writes for its tensors
            part = {n: want[n] for n, s in index["weight_map"].items() if s == f}
            save_file(part, str(tmp_path / f"ref-{f}"), metadata={"format": "pt"})
            assert (out / f).read_bytes() == (tmp_path / f"ref-{f}").read_bytes()
    assert (out / "config.json").read_bytes() == (tiny / "config.json").read_bytes()
    assert (out / "x").read_bytes() == b"1"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp")]


def test_write_checkpoint_full_disk_names_the_file_and_keeps_the_old_version(tiny, tmp_path, monkeypatch):
    import errno

    from symfuse.io import planned

    with CheckpointReader(tiny) as r:
        out = write_checkpoint(r, tmp_path / "out")
        before = (out / "model.safetensors").read_bytes()
        calls = []
        real = os.pwrite

        def full(fd, data, offset):
            calls.append(offset)
            if len(calls) > 3:  # the header and a few tensors fit, then the disk is full
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(fd, data, offset)

        monkeypatch.setattr(planned.os, "pwrite", full)
        with pytest.raises(OSError, match=r"model\.safetensors: could not be written .* free disk space") as info:
            write_checkpoint(r, out, replace=lambda n, t: t * 2, overwrite=True)
    assert info.value.errno == errno.ENOSPC and len(calls) == 4
    assert (out / "model.safetensors").read_bytes() == before  # the previous version, intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary folder left


def test_large_reads_split_across_threads_give_the_stored_bytes(tmp_path, monkeypatch):
    """In parallel_reads, a tensor over PARALLEL_READ is read in parts by several threads: same values; a
    truncation is named."""
    from symfuse.io import safetensors as st

    big = torch.randn(st.PARALLEL_READ // 4 + 1001)  # not a multiple of the part size
    file = tmp_path / "big.safetensors"
    save_file({"big": big, "small": torch.arange(5.0)}, str(file))
    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    parts = []
    real = st.TensorFile._pread

    def counted(self, fd, view, offset, name):
        parts.append(len(view))
        return real(self, fd, view, offset, name)

    monkeypatch.setattr(st.TensorFile, "_pread", counted)
    try:
        with TensorFile(file) as tf:
            assert torch.equal(tf.get("big"), big) and len(parts) == 1  # outside parallel_reads: one read
            with st.parallel_reads():
                assert torch.equal(tf.get("big"), big) and torch.equal(tf.get("small"), torch.arange(5.0))
            assert len(parts) == 4 and sum(parts[1:3]) == big.numel() * 4  # two parts, then "small" whole
        with TensorFile(file) as tf, st.parallel_reads():  # header read, then the file is cut short under it
            os.truncate(file, file.stat().st_size - 4096)
            with pytest.raises(CheckpointError, match=r"big.*truncated"):
                tf.get("big")
    finally:
        torch.set_num_threads(prev)


def test_planned_file_sync_error_names_the_file(tmp_path, monkeypatch):
    """The file is fsynced when its last tensor is in; a failure there names the file (fsync's own error does not)."""
    import errno

    from symfuse.io import planned

    layout = {"a": (torch.float32, (4,)), "b": (torch.float32, (2, 2))}
    pf = planned.PlannedFile(tmp_path / "x.safetensors", layout, {"format": "pt"})

    def broken(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(planned.os, "fsync", broken)
    pf.write("a", torch.ones(4))
    with pytest.raises(OSError, match=r"x\.safetensors: could not be written \(Input/output error\)"):
        pf.write("b", torch.zeros(2, 2))
    pf.close()
    monkeypatch.undo()
    ok = planned.PlannedFile(tmp_path / "y.safetensors", layout, {"format": "pt"})
    ok.write("b", torch.zeros(2, 2))
    ok.write("a", torch.ones(4))
    ok.finish()
    assert torch.equal(load_file(str(tmp_path / "y.safetensors"))["a"], torch.ones(4))


def test_a_file_settles_after_its_file_systems_clock_granularity(monkeypatch):
    from types import SimpleNamespace

    from symfuse.io import memo

    def at(changed_ns: int, now_ns: int):
        st = SimpleNamespace(st_dev=1, st_ino=2, st_size=3, st_mtime_ns=changed_ns, st_ctime_ns=changed_ns)
        monkeypatch.setattr(memo, "os", SimpleNamespace(stat=lambda _path: st))  # memo's own names only
        monkeypatch.setattr(memo, "time", SimpleNamespace(time_ns=lambda: now_ns))
        return memo.settled_identity("f")

    t = 1_700_000_000_000_000_000
    fine = t + 123_457  # a sub-millisecond part: a fine clock (ext4, xfs, tmpfs), settled after 100 ms
    assert at(fine, fine + 50_000_000) is None and at(fine, fine + 100_000_000) == (1, 2, 3, fine, fine)
    coarse = t  # whole seconds: a coarse clock (FAT, some network mounts), settled after 2 s
    assert at(coarse, coarse + 1_000_000_000) is None and at(coarse, coarse + 2_000_000_000) is not None


def test_planned_file_row_blocks_from_several_threads_give_the_bytes_save_file_writes(tmp_path):
    """Blocks of rows of one tensor written concurrently (as the match pipeline's workers do): identical file."""
    import threading

    from symfuse.io.planned import PlannedFile

    g = torch.Generator().manual_seed(0)
    tensors = {  # odd sizes and several dtypes: tensors start and end off any alignment
        "a": torch.randn(1001, 7, generator=g),
        "b": torch.randn(3, generator=g),
        "c": torch.randn(2049, 5, generator=g).to(torch.bfloat16),
        "d": torch.randn(4096 * 3 + 5, generator=g, dtype=torch.float64),
    }
    layout = {n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()}
    pf = PlannedFile(tmp_path / "x.safetensors", layout, {"format": "pt"})
    jobs = [("a", r, tensors["a"][r : r + 300]) for r in range(0, 1001, 300)]
    jobs += [("c", r, tensors["c"][r : r + 700]) for r in range(0, 2049, 700)]
    jobs += [("b", 0, tensors["b"]), ("d", 0, tensors["d"])]
    threads = [threading.Thread(target=pf.write, args=(n, t, r)) for n, r, t in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    pf.finish()
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    assert (tmp_path / "x.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
