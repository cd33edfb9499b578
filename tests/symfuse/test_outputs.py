"""``symfuse.outputs``: refused existing outputs, atomic swaps, the lock, stale temp folders (in-process)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from symfuse.errors import OutputExistsError, OutputLockedError, UsageError
from symfuse.outputs import MARKER, atomic_output_dir, check_output, claim_output, clean_stale_temps, lock_path


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_writes_appear_only_at_the_end(tmp_path):
    out = tmp_path / "out"
    with atomic_output_dir(out) as tmp:
        (tmp / "a.txt").write_text("new")
        assert not out.exists()
        assert tmp.parent == tmp_path and tmp.name.startswith(f".out.tmp-{os.getpid()}-")
        assert lock_path(out).exists()
    assert (out / "a.txt").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp, no lock left


def test_existing_output_is_refused_without_overwrite_and_kept(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(OutputExistsError, match="--overwrite"), atomic_output_dir(out):
        pytest.fail("the block must not run")
    assert (out / "old.txt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_an_output_that_is_a_link_is_refused_naming_its_target(tmp_path):
    """A link to a folder was "exists and is not a folder" (it is one, through the link); it is kept either way."""
    target = tmp_path / "real"
    target.mkdir()
    (tmp_path / "link").symlink_to(target)
    for overwrite in (False, True):
        with pytest.raises(OutputExistsError, match=rf"link: is a symbolic link \(to {target}\) — give the folder"):
            check_output(tmp_path / "link", overwrite=overwrite)
    assert (tmp_path / "link").is_symlink() and target.is_dir()


def _earlier_output(out):
    with atomic_output_dir(out) as tmp:  # what an earlier symfuse command wrote
        (tmp / "old.txt").write_text("old")


def test_overwrite_keeps_the_old_version_readable_until_the_swap(tmp_path):
    out = tmp_path / "out"
    _earlier_output(out)
    with atomic_output_dir(out, overwrite=True) as tmp:
        (tmp / "new.txt").write_text("new")
        assert (out / "old.txt").read_text() == "old"
    assert sorted(p.name for p in out.iterdir()) == sorted([MARKER, "new.txt"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_failure_removes_the_temp_folder_and_keeps_the_old_version(tmp_path):
    out = tmp_path / "out"
    _earlier_output(out)
    with pytest.raises(RuntimeError), atomic_output_dir(out, overwrite=True) as tmp:
        (tmp / "half.txt").write_text("half")
        raise RuntimeError("boom")
    assert sorted(p.name for p in out.iterdir()) == sorted([MARKER, "old.txt"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def _tree(folder):
    return {p.relative_to(folder): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


def test_overwrite_replaces_an_empty_folder_but_never_a_folder_symfuse_did_not_write(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with atomic_output_dir(empty, overwrite=True) as tmp:
        (tmp / "new.txt").write_text("new")
    assert (empty / "new.txt").read_text() == "new"
    data = tmp_path / "data"  # a dataset, a hand-made checkpoint ...
    data.mkdir()
    (data / "train.jsonl").write_text('{"text": "x", "label": "joy"}\n')
    before = _tree(tmp_path)
    with pytest.raises(OutputExistsError, match="only a folder symfuse wrote"), atomic_output_dir(data, True):
        pytest.fail("the block must not run")
    assert _tree(tmp_path) == before


def test_overwrite_never_deletes_files_a_user_added_to_a_symfuse_output(tmp_path):
    """A merge output with the user's notes added: --overwrite deleted them (the marker said the folder was ours)."""
    out = tmp_path / "merged"
    with atomic_output_dir(out) as tmp:
        (tmp / "model.safetensors").write_text("v1")
        (tmp / "heads" / "b").mkdir(parents=True)
        (tmp / "heads" / "b" / "model.safetensors").write_text("v1")
    with atomic_output_dir(out, overwrite=True) as tmp:  # what symfuse wrote is replaced
        (tmp / "model.safetensors").write_text("v2")
    assert (out / "model.safetensors").read_text() == "v2" and not (out / "heads").exists()
    (out / "mynotes.txt").write_text("mine")
    (out / "mine").mkdir()
    (out / "mine" / "y").write_text("mine")
    before = _tree(tmp_path)
    added = r"merged: holds mine/y, mynotes\.txt, which symfuse did not write"
    with pytest.raises(OutputExistsError, match=added), atomic_output_dir(out, overwrite=True):
        pytest.fail("the block must not run")
    assert _tree(tmp_path) == before
    (out / MARKER).write_text("written by symfuse: --overwrite may replace this folder\n")  # an older marker
    with atomic_output_dir(out, overwrite=True) as tmp:
        (tmp / "model.safetensors").write_text("v3")
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "model.safetensors"]


def test_overwrite_never_replaces_an_input_a_folder_holding_one_or_the_working_folder(tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    model = runs / "model"
    _earlier_output(runs)  # a symfuse output, which --overwrite could replace ...
    _earlier_output(model)  # ... but it holds the input
    before = _tree(tmp_path)
    for out in (model, runs):
        with pytest.raises(OutputExistsError, match="is or holds the input"):
            check_output(out, overwrite=True, inputs=["minilm", None, str(model)])
    with pytest.raises(OutputExistsError, match="is or holds the input"):  # the same folder through a link
        (tmp_path / "link").symlink_to(model)
        check_output(model, overwrite=True, inputs=[tmp_path / "link"])
    (tmp_path / "link").unlink()
    monkeypatch.chdir(model)
    for out in (".", "..", str(model)):
        with pytest.raises(OutputExistsError, match="runs in"):
            check_output(out, overwrite=True)
    with pytest.raises(UsageError, match="--out is empty"):
        check_output("", overwrite=True)
    assert _tree(tmp_path) == before
    monkeypatch.chdir(tmp_path)
    assert check_output(model, overwrite=True, inputs=[runs / "other"]) == model  # a sibling input is fine


def test_an_output_that_appears_while_writing_is_not_deleted(tmp_path):
    out = tmp_path / "out"
    for overwrite in (False, True):
        with (
            pytest.raises(OutputExistsError, match="left untouched"),
            atomic_output_dir(out, overwrite=overwrite) as tmp,
        ):
            (tmp / "ours.txt").write_text("ours")
            out.mkdir()  # someone else's folder, created meanwhile
            (out / "theirs.txt").write_text("theirs")
        assert sorted(p.name for p in out.iterdir()) == ["theirs.txt"]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
        (out / "theirs.txt").unlink()
        out.rmdir()


def test_an_output_replaced_while_writing_with_overwrite_is_not_deleted(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(OutputExistsError), atomic_output_dir(out, overwrite=True):
        out.rename(tmp_path / "moved")
        out.mkdir()
        (out / "theirs.txt").write_text("theirs")
    assert sorted(p.name for p in out.iterdir()) == ["theirs.txt"]


def test_parent_folders_made_for_a_failed_output_are_removed(tmp_path):
    out = tmp_path / "x" / "y" / "out"
    with pytest.raises(RuntimeError), atomic_output_dir(out):
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_claim_is_reentrant_in_one_process(tmp_path):
    out = tmp_path / "out"
    with claim_output(out):
        with atomic_output_dir(out) as tmp:
            (tmp / "f").write_text("x")
        assert lock_path(out).exists()  # still held by the outer claim
    assert not lock_path(out).exists() and (out / "f").exists()


def test_a_second_process_fails_fast_naming_the_lock_holder(tmp_path):
    out = tmp_path / "out"
    code = textwrap.dedent(
        f"""
        import sys
        from symfuse.errors import OutputLockedError
        from symfuse.outputs import claim_output
        try:
            with claim_output({str(out)!r}):
                pass
        except OutputLockedError as exc:
            print(exc)
            sys.exit(3)
        """
    )
    with claim_output(out):
        t0 = time.perf_counter()
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
        assert res.returncode == 3, res.stderr
        assert f"pid {os.getpid()}" in res.stdout and str(out) in res.stdout
        assert time.perf_counter() - t0 < 30
    with claim_output(out):  # released: free again
        pass


def test_lock_error_type_is_a_builtin(tmp_path):
    assert issubclass(OutputLockedError, OSError) and issubclass(OutputExistsError, FileExistsError)


def test_stale_temp_folders_of_dead_writers_are_removed_at_the_next_claim(tmp_path):
    out = tmp_path / "out"
    dead, alive = _dead_pid(), os.getppid()
    stale = [
        tmp_path / f".out.tmp-{dead}-abcd",
        tmp_path / f"..out.tmp-{dead}-abcd.tmp-xyz",
        tmp_path / f".out.old-{dead}-1",
    ]
    live = tmp_path / f".out.tmp-{alive}-abcd"
    other = tmp_path / f".other.tmp-{dead}-abcd"
    for p in [*stale, live, other]:
        p.mkdir()
        (p / "model.safetensors").write_text("half")
    with atomic_output_dir(out) as tmp:
        (tmp / "f").write_text("x")
    assert not any(p.exists() for p in stale)
    assert live.exists() and other.exists()  # a live writer's, and another output's
    assert clean_stale_temps(out) == []


def test_another_thread_of_the_process_cannot_enter_a_claim(tmp_path):
    import threading

    out, errors = tmp_path / "out", []

    def other():
        try:
            with atomic_output_dir(out):
                pass
        except OutputLockedError as exc:
            errors.append(exc)

    with claim_output(out):
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert len(errors) == 1 and "another thread" in str(errors[0]) and not out.exists()


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc, a folder that takes no new file")
def test_an_output_in_a_folder_that_takes_no_file_is_named_not_its_lock():
    """``--out /proc/x`` said "/proc/.x.lock: no such file or directory", naming a file the user never gave."""
    words = r"^/proc/x: cannot be written \(no such file or directory: its lock file "
    with pytest.raises(UsageError, match=words), atomic_output_dir("/proc/x"):
        pass


def test_an_output_inside_one_still_being_written_is_not_published_until_that_one_is(tmp_path):
    """match-many's per-model folders lie in its staging folder: an interrupt said one 'stays', and it was removed."""
    from symfuse.outputs import clear_published, published

    clear_published()
    with pytest.raises(KeyboardInterrupt), atomic_output_dir(tmp_path / "all") as tmp:
        with atomic_output_dir(tmp / "one") as inner:
            (inner / "x").write_text("x")
        assert (tmp / "one" / "x").is_file() and published() == []
        raise KeyboardInterrupt
    assert published() == [] and not (tmp_path / "all").exists()
    with atomic_output_dir(tmp_path / "all") as tmp, atomic_output_dir(tmp / "one") as inner:
        (inner / "x").write_text("x")
    assert published() == [str(tmp_path / "all")]


def test_a_name_too_long_for_its_temporary_sibling_is_refused_before_the_work(tmp_path):
    """240 characters passed (the lock's name fits), and the output failed after a whole fine-tune."""
    longest = 255 - len("..tmp-0000000-00000000") - len("..tmp-00000000")
    with pytest.raises(UsageError, match=rf"a name of 240 bytes — .* give a name of at most {longest}"):
        check_output(tmp_path / ("y" * 240))
    with atomic_output_dir(tmp_path / ("y" * longest)) as tmp:
        (tmp / "x").write_text("x")
    assert (tmp_path / ("y" * longest) / "x").is_file()
