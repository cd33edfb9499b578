"""Scratch folders name their owner; the ones a SIGKILLed process left are removed, live owners' never."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import symfuse
from symfuse.scratch import PREFIX, clean_stale_scratch, scratch_dir


def test_scratch_folder_names_its_owner_and_is_removed_after(tmp_path):
    with scratch_dir("merge", root=tmp_path) as folder:
        assert folder.parent == tmp_path and folder.name.startswith(f"{PREFIX}{os.getpid()}-")
        (folder / "model.safetensors").write_bytes(b"x")
        assert clean_stale_scratch(tmp_path) == []  # its owner (this process) runs
        assert folder.is_dir()
    assert not folder.exists()


def test_folders_of_a_sigkilled_process_are_removed_and_nothing_else(tmp_path):
    code = textwrap.dedent(f"""
        import sys, time
        from symfuse.scratch import scratch_dir
        with scratch_dir("eval", root={str(tmp_path)!r}) as folder:
            (folder / "half.bin").write_bytes(b"x" * 100)
            print(folder, flush=True)
            time.sleep(600)
    """)
    # this checkout's library only: the whole sys.path of a pytest run holds test folders such as flows/, whose
    # select.py would shadow the standard library's select module in the child
    src = Path(symfuse.__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), str(src.parent)])}
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    left = tmp_path / os.path.basename(proc.stdout.readline().strip())
    assert left.is_dir()
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    assert left.is_dir(), "SIGKILL runs no cleanup"
    # a live owner's folder (this process), a reused pid (this process with another start time), foreign folders
    live = tmp_path / f"{PREFIX}{os.getpid()}-{int(__import__('psutil').Process().create_time())}-merge-abc"
    reused = tmp_path / f"{PREFIX}{os.getpid()}-1000-merge-def"
    foreign = [tmp_path / "symfuse-merge-old", tmp_path / "mine", tmp_path / f"{PREFIX}notapid-1-x"]
    for folder in [live, reused, *foreign]:
        folder.mkdir()
        (folder / "f").write_text("keep?")
    (tmp_path / f"{PREFIX}{proc.pid}-1-file").write_text("a file, not a folder")

    assert sorted(clean_stale_scratch(tmp_path)) == sorted([left, reused])
    assert not left.exists() and not reused.exists()
    assert live.is_dir() and all(f.is_dir() for f in foreign)
    assert (tmp_path / f"{PREFIX}{proc.pid}-1-file").is_file()
    assert clean_stale_scratch(tmp_path / "absent") == []


def test_a_folder_of_another_machine_or_container_is_never_judged_by_a_pid_of_this_one(tmp_path):
    """Workers sharing a scratch volume from their own PID namespaces: pid 1's live folder was removed by another."""
    from symfuse.scratch import host_tag

    with scratch_dir("merge", root=tmp_path) as mine:
        assert f"-h{host_tag()}-merge-" in mine.name
    dead = 2**22 + 12345  # past pid_max: no process runs it here
    other = tmp_path / f"{PREFIX}{dead}-1-h{'0' * 8 if host_tag() != '0' * 8 else '1' * 8}-merge-abc"
    ours = tmp_path / f"{PREFIX}{dead}-1-h{host_tag()}-merge-def"
    for folder in (other, ours):
        folder.mkdir()
    assert clean_stale_scratch(tmp_path) == [ours] and other.is_dir()
