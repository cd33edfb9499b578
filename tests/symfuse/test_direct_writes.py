"""Direct (O_DIRECT) writes of planned safetensors files: same bytes as save_file, refusals fall back to buffered."""

from __future__ import annotations

import errno
import os
import threading
import time

import pytest
import torch
from safetensors.torch import save_file

from symfuse.io import direct, planned


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.tiny import save_tiny

    return save_tiny(tmp_path_factory.mktemp("tiny") / "m", "bert", seed=0)


def _layout(tensors):
    return {n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()}


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {  # odd sizes: every tensor starts and ends off the 4 KiB grid
        "a": torch.randn(1001, 7, generator=g),
        "b": torch.randn(3, generator=g),
        "c": torch.randn(2049, 5, generator=g).to(torch.bfloat16),
        "d": torch.randn(4096 * 3 + 5, generator=g, dtype=torch.float64),
    }


@pytest.fixture
def small_direct(monkeypatch, tmp_path):
    """Direct writes for anything over 4 KiB, where the test folder's file system allows them."""
    if not direct.direct_writes_wanted(tmp_path):
        pytest.skip(f"no direct writes on this file system ({direct.filesystem_type(tmp_path)})")
    monkeypatch.setattr(direct, "DIRECT_MIN_BYTES", 4096)


def _assert_save_files_bytes(tmp_path, tensors):
    """``tmp_path / "x.safetensors"`` holds the bytes save_file writes for ``tensors``."""
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    assert (tmp_path / "x.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def _write_rest_and_compare(pf, tmp_path, tensors, names, hand_over=False):
    """Write ``names``, finish the file, and compare it with save_file's bytes."""
    for name in names:
        pf.write(name, tensors[name], hand_over=hand_over)
    pf.finish()
    _assert_save_files_bytes(tmp_path, tensors)


def _expected_direct_bytes(path, tensors):
    """Bytes of the 4 KiB-aligned middles of every tensor of at least 4 KiB in the file written."""
    from symfuse.io.safetensors import read_header

    total = 0
    for name, info in read_header(path).tensors.items():
        if tensors[name].nbytes >= 4096:
            a, b = -(-info.begin // 4096) * 4096, info.end // 4096 * 4096
            total += max(0, b - a)
    return total


def test_direct_writes_give_the_bytes_save_file_writes(tmp_path, small_direct):
    tensors = _tensors()
    pf = planned.PlannedFile(tmp_path / "x.safetensors", _layout(tensors), {"format": "pt"})
    for name in ("d", "b", "a", "c"):  # any order
        pf.write(name, tensors[name])
    written = pf._direct.direct_bytes
    assert pf._direct._executor is None and not pf._direct.active  # the last tensor in: thread and buffers freed
    pf.finish()
    _assert_save_files_bytes(tmp_path, tensors)
    assert written == _expected_direct_bytes(tmp_path / "x.safetensors", tensors) > 3 * 4096


def test_row_blocks_from_several_threads_give_the_same_bytes(tmp_path, small_direct):
    """Blocks of rows of one tensor written concurrently (as the match pipeline's workers do): identical file."""
    tensors = _tensors()
    pf = planned.PlannedFile(tmp_path / "x.safetensors", _layout(tensors), {"format": "pt"})
    jobs = [("a", r, tensors["a"][r : r + 300]) for r in range(0, 1001, 300)]
    jobs += [("c", r, tensors["c"][r : r + 700]) for r in range(0, 2049, 700)]
    jobs += [("b", 0, tensors["b"]), ("d", 0, tensors["d"])]
    threads = [threading.Thread(target=pf.write, args=(n, t, r)) for n, r, t in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert pf._direct.direct_bytes > 0
    pf.finish()
    _assert_save_files_bytes(tmp_path, tensors)


@pytest.mark.parametrize("failure", ["refused", "short"])
def test_a_refused_or_short_direct_write_is_finished_buffered(tmp_path, small_direct, monkeypatch, failure):
    """EINVAL from a direct write switches direct writes off for the file; a short one writes its rest buffered."""
    tensors = _tensors()
    pf = planned.PlannedFile(tmp_path / "x.safetensors", _layout(tensors), {"format": "pt"})
    direct_fd = pf._direct._fd
    real = os.pwrite
    calls = []

    def flaky(fd, data, offset):
        if fd != direct_fd:
            return real(fd, data, offset)
        calls.append(len(data))
        if failure == "refused":
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data[:4096], offset)  # one block of what was asked

    monkeypatch.setattr(direct.os, "pwrite", flaky)
    pf.write("d", tensors["d"])
    pf._direct.flush()
    if failure == "refused":
        assert not pf._direct.active and pf._direct.direct_bytes == 0 and len(calls) == 1
    else:
        assert pf._direct.active and pf._direct.direct_bytes == 4096
    for name in ("a", "b", "c"):
        pf.write(name, tensors[name])
    pf.finish()
    _assert_save_files_bytes(tmp_path, tensors)


def test_a_direct_write_error_names_the_file(tmp_path, small_direct, monkeypatch):
    tensors = _tensors()
    pf = planned.PlannedFile(tmp_path / "x.safetensors", _layout(tensors), {"format": "pt"})
    direct_fd = pf._direct._fd
    real = os.pwrite

    def full(fd, data, offset):
        if fd == direct_fd:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(direct.os, "pwrite", full)
    pf.write("d", tensors["d"])  # queued: the error comes with the next write, or the flush before the fsync
    for name in ("a", "b", "c"):
        try:
            pf.write(name, tensors[name])
        except OSError as exc:
            raised = exc
            break
    else:
        with pytest.raises(OSError) as info:
            pf.finish()
        raised = info.value
    assert raised.errno == errno.ENOSPC
    assert "x.safetensors: could not be written (No space left on device) — free disk space" in str(raised)
    pf.close()
    assert pf._direct._fd == -1 and pf._direct._executor is None


def test_direct_writes_only_where_wanted(tmp_path, monkeypatch):
    """Off by SYMFUSE_DIRECT_WRITES=0 and on file systems not known to support them (tmpfs, network, FUSE)."""
    if direct.filesystem_type(tmp_path) is None:
        assert not direct.direct_writes_wanted(tmp_path)  # no statfs here: never direct
        return
    monkeypatch.setattr(direct, "filesystem_type", lambda path: 0x01021994)  # tmpfs
    assert not direct.direct_writes_wanted(tmp_path)
    monkeypatch.setattr(direct, "filesystem_type", lambda path: 0xEF53)  # ext4
    assert direct.direct_writes_wanted(tmp_path)
    off = planned.PlannedFile(tmp_path / "off.safetensors", _layout(_tensors()), direct=False)  # the caller's choice
    assert not off._direct.active
    off.close()
    monkeypatch.setenv("SYMFUSE_DIRECT_WRITES", "0")
    assert not direct.direct_writes_wanted(tmp_path)
    tensors = _tensors()
    pf = planned.PlannedFile(tmp_path / "x.safetensors", _layout(tensors), {"format": "pt"})
    assert not pf._direct.active and pf._direct.middle(0, 1 << 30) == (0, 0)
    pf.close()


@pytest.mark.parametrize("shard_bytes", [2 * 1024**3, 8 * 1024])
def test_write_checkpoint_with_direct_writes_is_save_files_bytes(tiny, tmp_path, small_direct, shard_bytes):
    """One file or many shards (each shard's writer thread and buffers freed when its last tensor is in)."""
    import json

    from safetensors.torch import load_file

    from symfuse.checkpoint import CheckpointReader, write_checkpoint
    from symfuse.io.safetensors import read_header

    sd = load_file(str(tiny / "model.safetensors"))
    threads = threading.active_count()
    with CheckpointReader(tiny) as r:
        out = write_checkpoint(
            r, tmp_path / "out", replace=lambda n, t: t * 3 if t.is_floating_point() else t, shard_bytes=shard_bytes
        )
    assert threading.active_count() == threads  # no writer thread left behind
    want = {n: t * 3 if t.is_floating_point() else t for n, t in sd.items()}
    files = sorted(p.name for p in out.glob("*.safetensors"))
    if len(files) == 1:
        parts = {"model.safetensors": want}
    else:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        parts = {f: {n: want[n] for n, s in index["weight_map"].items() if s == f} for f in files}
    direct_total = 0
    for f, part in parts.items():
        save_file(part, str(tmp_path / f"ref-{f}"), metadata={"format": "pt"})
        assert (out / f).read_bytes() == (tmp_path / f"ref-{f}").read_bytes()
        assert sorted(read_header(out / f).tensors) == sorted(part)
        direct_total += _expected_direct_bytes(out / f, part)
    assert direct_total > 0 and (len(files) > 2) == (shard_bytes < 1024**2)


def _gated_pwrite(monkeypatch, pf):
    """Direct writes of ``pf`` wait for ``gate``; returns (gate, number of direct writes done)."""
    gate, done = threading.Event(), []
    direct_fd, real = pf._direct._fd, os.pwrite

    def gated(fd, data, offset):
        if fd == direct_fd:
            assert gate.wait(30), "the test never opened the gate"
            done.append(len(data))
        return real(fd, data, offset)

    monkeypatch.setattr(direct.os, "pwrite", gated)
    return gate, done


def test_a_handed_over_tensor_is_written_from_the_writer_thread(tmp_path, small_direct, monkeypatch):
    """write() returns before any of the large middle is copied; the tensor is kept alive until it is written."""
    import weakref

    tensors = _tensors()
    pf = planned.PlannedFile(tmp_path / "x.safetensors", _layout(tensors), {"format": "pt"})
    gate, done = _gated_pwrite(monkeypatch, pf)
    owners, queue_write = [], pf._direct.write

    def spy(view, offset, owner=None):
        owners.append(weakref.ref(owner))  # what keeps the handed-over memory alive
        queue_write(view, offset, owner)

    monkeypatch.setattr(pf._direct, "write", spy)
    mine = tensors["d"].clone()
    pf.write("d", mine, hand_over=True)  # returns with the disk write blocked: nothing copied in this thread
    assert owners[0]().data_ptr() == mine.data_ptr()  # the caller's own memory, no copy
    del mine
    assert owners[0]() is not None and not done and pf._direct._handed_over > 0
    gate.set()
    pf._direct.flush()
    assert pf._direct._handed_over == 0 and sum(done) > 0
    deadline = time.monotonic() + 10
    while owners[0]() is not None and time.monotonic() < deadline:  # the writer's call returns just after flush
        time.sleep(0.01)
    assert owners[0]() is None  # let go once written
    _write_rest_and_compare(pf, tmp_path, tensors, ("a", "b", "c"), hand_over=True)


def test_without_hand_over_the_caller_may_change_its_tensor_at_once(tmp_path, small_direct, monkeypatch):
    """The default copies the bytes before write() returns (a reused buffer stays the caller's)."""
    tensors = _tensors()
    pf = planned.PlannedFile(tmp_path / "x.safetensors", _layout(tensors), {"format": "pt"})
    gate, _ = _gated_pwrite(monkeypatch, pf)
    reused = tensors["d"].clone()
    pf.write("d", reused)
    reused.fill_(float("nan"))  # the caller's next use of its buffer, before the disk saw a byte
    strided = tensors["a"].T.contiguous().T  # not contiguous: write() takes its own copy, handed over
    strided_copy = strided.clone()
    pf.write("a", strided)
    gate.set()
    _write_rest_and_compare(pf, tmp_path, tensors, ("b", "c"))
    assert torch.equal(strided, strided_copy)


def test_handed_over_bytes_are_bounded(tmp_path, small_direct, monkeypatch):
    """Past HANDED_OVER_BYTES waiting for the disk, the caller waits (memory bound); then every byte lands."""
    monkeypatch.setattr(direct, "HANDED_OVER_BYTES", 8192)
    tensors = _tensors()
    pf = planned.PlannedFile(tmp_path / "x.safetensors", _layout(tensors), {"format": "pt"})
    gate, _ = _gated_pwrite(monkeypatch, pf)
    pf.write("d", tensors["d"], hand_over=True)  # ~12 KiB handed over: the budget is spent
    second = threading.Thread(target=pf.write, args=("a", tensors["a"]), kwargs={"hand_over": True})
    second.start()
    second.join(0.5)
    assert second.is_alive()  # waiting for the first to be copied out
    gate.set()
    second.join(30)
    assert not second.is_alive()
    _write_rest_and_compare(pf, tmp_path, tensors, ("b", "c"), hand_over=True)


def test_a_handed_over_write_error_names_the_file(tmp_path, small_direct, monkeypatch):
    tensors = _tensors()
    pf = planned.PlannedFile(tmp_path / "x.safetensors", _layout(tensors), {"format": "pt"})
    direct_fd, real = pf._direct._fd, os.pwrite

    def full(fd, data, offset):
        if fd == direct_fd:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(direct.os, "pwrite", full)
    pf.write("d", tensors["d"], hand_over=True)
    with pytest.raises(OSError) as info:
        pf._direct.flush()
    assert info.value.errno == errno.ENOSPC and "x.safetensors: could not be written" in str(info.value)
    pf.close()
    assert pf._direct._executor is None and pf._direct._handed_over == 0


def test_buffer_pool_knows_its_buffers():
    from symfuse.io import BufferPool

    pool = BufferPool()
    t = pool.take("x", (10, 3), torch.float32)
    assert pool.holds(t) and pool.holds(t[2:]) and not pool.holds(t.clone())


def test_handed_over_and_copied_writes_of_one_file_never_wait_on_each_other(tmp_path, small_direct, monkeypatch):
    """A copied write waiting for bounce buffers while a handed-over one is being written: both finish.

    The handed-over write runs in the writer thread with that thread's own buffer: had it taken bounce buffers too,
    a caller waiting for one could take the one it gave back, with the caller's own pieces queued behind it in the
    one writer thread: a deadlock (a race, so the test also checks that the writer thread never takes one).
    """
    import queue

    takers: list[str] = []

    class Recording(queue.SimpleQueue):
        def get(self, *args, **kwargs):
            item = super().get(*args, **kwargs)
            if isinstance(item, memoryview):  # a bounce buffer (the executor's work queue is one of these too)
                takers.append(threading.current_thread().name)
            return item

    monkeypatch.setattr(direct.queue, "SimpleQueue", Recording)
    monkeypatch.setattr(direct, "BOUNCE_BYTES", 4096)
    monkeypatch.setattr(direct, "BOUNCE_BUFFERS", 2)
    tensors = _tensors()
    pf = planned.PlannedFile(tmp_path / "x.safetensors", _layout(tensors), {"format": "pt"})
    gate, _ = _gated_pwrite(monkeypatch, pf)

    def writes():
        pf.write("d", tensors["d"], hand_over=True)  # ~24 pieces, the first held at the gate
        pf.write("a", tensors["a"])  # copied: 7 pieces through 2 bounce buffers
        pf.write("c", tensors["c"], hand_over=True)
        pf.write("b", tensors["b"])
        pf.finish()

    worker = threading.Thread(target=writes, daemon=True)
    worker.start()
    time.sleep(0.3)
    gate.set()
    worker.join(60)
    assert not worker.is_alive(), "the writes deadlocked"
    _assert_save_files_bytes(tmp_path, tensors)
    assert takers and not [t for t in takers if t.startswith("symfuse-write")]  # only callers take bounce buffers
