"""What symfuse writes gets the permissions of a plain ``mkdir`` / ``open``, not the private ones of mkdtemp."""

from __future__ import annotations

import os
import stat
import tempfile

import pytest
import torch
from typer.testing import CliRunner

from symfuse.cli import app
from symfuse.cli import commands as _commands  # noqa: F401  (registers the commands)
from symfuse.io import plain_mode, save_safetensors, umask
from symfuse.stats.collect import _move_in
from tests.tiny import save_tiny

UMASKS = [0o022, 0o027, 0o002]


@pytest.fixture(params=UMASKS, ids=oct)
def mask(request):
    """The process runs the test under this umask (restored afterwards)."""
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("modes")
    return [save_tiny(d / f"m{i}", "llama", seed=i, head="lm") for i in (1, 2)]


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _mkdir_mode(parent) -> int:
    ref = parent / "made-by-mkdir"
    os.mkdir(ref)
    return _mode(ref)


def _open_mode(parent) -> int:
    ref = parent / "made-by-open"
    ref.write_bytes(b"")
    return _mode(ref)


def test_umask_is_read_without_changing_it(mask):
    assert umask() == mask
    assert umask() == mask  # still set: reading did not change it


def test_a_merge_output_folder_has_the_mode_of_a_plain_mkdir(models, tmp_path, mask):
    """``symfuse merge`` writes through atomic_dir, whose mkdtemp folder was renamed into place as 0700."""
    out = tmp_path / "merged"
    res = CliRunner().invoke(app, ["merge", "--strategy", "simple", "--models", *map(str, models), "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert _mode(out) == _mkdir_mode(tmp_path) == 0o777 & ~mask
    assert _mode(out / "model.safetensors") & 0o044 == 0o044 & ~mask  # readable by whom the umask allows


def test_atomic_files_and_statistics_folders_get_plain_modes(tmp_path, mask):
    """save_safetensors (mkstemp, 0600) and a statistics folder (mkdtemp, 0700) renamed into place."""
    file = save_safetensors({"x": torch.zeros(2)}, tmp_path / "x.safetensors")
    assert _mode(file) == _open_mode(tmp_path) == 0o666 & ~mask
    tmp = tempfile.mkdtemp(dir=tmp_path)
    _move_in(tmp_path / os.path.basename(tmp), tmp_path / "stats", tmp_path, "fingerprint")  # out is new: model unread
    assert _mode(tmp_path / "stats") == _mkdir_mode(tmp_path)


def test_plain_mode_keeps_an_inherited_set_group_id_bit(tmp_path, mask):
    parent = tmp_path / "shared"
    parent.mkdir()
    os.chmod(parent, 0o2775)
    folder = tempfile.mkdtemp(dir=parent)
    assert os.stat(folder).st_mode & stat.S_ISGID  # Linux: inherited from the parent
    plain_mode(folder)
    assert _mode(folder) == stat.S_ISGID | (0o777 & ~mask)
