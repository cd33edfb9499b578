"""Weights this user may not read are named as a permission problem, not as a file to re-save or a missing one.

The tests run as root, which reads every file whatever its mode: a file is made unreadable by raising
``PermissionError`` where it is opened (``open`` / ``os.open``), and safetensors' loader, which reports EACCES as
``FileNotFoundError: No such file or directory``, is made to do so; the real ``chmod 000`` case runs as another user.
"""

from __future__ import annotations

import builtins
import io
import os

import pytest
import safetensors
from typer.testing import CliRunner

from symfuse.checkpoint import validate_checkpoint
from symfuse.cli import app
from symfuse.cli import commands as _commands  # noqa: F401  (registers the commands)
from symfuse.errors import CheckpointError
from symfuse.io import read_header
from tests.cli.helpers import toy_dataset
from tests.tiny import save_tiny, save_tiny_text_classifier

FIX = "not readable by this user (permission denied) — fix its permissions (chmod a+r) or run as its owner"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("unreadable")
    return {
        "a": save_tiny(d / "a", "llama", seed=1, head="lm"),
        "b": save_tiny(d / "b", "llama", seed=2, head="lm"),
        "clf": save_tiny_text_classifier(d / "clf"),
        "data": toy_dataset(d / "data"),
    }


@pytest.fixture
def deny(monkeypatch):
    """``deny(file)``: opening ``file`` fails as for another user's 0600 file."""
    denied: set[str] = set()
    real_open, real_os_open, real_safe_open = builtins.open, os.open, safetensors.safe_open

    def refuse(file):
        if os.path.abspath(os.fspath(file)) in denied:
            raise PermissionError(13, "Permission denied", os.fspath(file))

    def fake_open(file, *args, **kwargs):
        if isinstance(file, str | os.PathLike):
            refuse(file)
        return real_open(file, *args, **kwargs)

    def fake_os_open(file, *args, **kwargs):
        refuse(file)
        return real_os_open(file, *args, **kwargs)

    def fake_safe_open(file, *args, **kwargs):  # what safetensors (Rust) really raises for EACCES
        if os.path.abspath(os.fspath(file)) in denied:
            raise FileNotFoundError(f"No such file or directory: {file}")
        return real_safe_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(io, "open", fake_open)  # pathlib's read_bytes / read_text
    monkeypatch.setattr(os, "open", fake_os_open)
    monkeypatch.setattr(safetensors, "safe_open", fake_safe_open)
    return lambda file: denied.add(os.path.abspath(file))


def _error_line(res) -> str:
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert "Traceback" not in res.output, res.output
    return lines[-1]


def test_merge_names_an_unreadable_weight_file(inputs, deny, tmp_path):
    weights = inputs["a"] / "model.safetensors"
    deny(weights)
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["merge", "--strategy", "simple", "--models", str(inputs["a"]), str(inputs["b"]),
                                   "--out", str(out)], terminal_width=200)  # fmt: skip
    assert res.exit_code == 1, res.output
    assert _error_line(res) == f"error: {weights}: {FIX}"
    assert not out.exists()


def test_stats_names_an_unreadable_weight_file_not_a_missing_one(inputs, deny, tmp_path):
    weights = inputs["clf"] / "model.safetensors"
    deny(weights)
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["stats", str(inputs["clf"]), "--data", str(inputs["data"]), "--out", str(out)],
                             terminal_width=200)  # fmt: skip
    assert res.exit_code == 1, res.output
    assert _error_line(res) == f"error: {weights}: {FIX}"
    assert not out.exists()


def test_the_library_readers_name_unreadable_files(inputs, deny):
    """validate_checkpoint (load_hf_model's first step), a shard index and config.json."""
    weights, config = inputs["a"] / "model.safetensors", inputs["b"] / "config.json"
    deny(weights)
    with pytest.raises(CheckpointError) as info:
        validate_checkpoint(inputs["a"])
    assert str(info.value) == f"{weights}: {FIX}"
    deny(config)
    with pytest.raises(CheckpointError) as info:
        validate_checkpoint(inputs["b"])
    assert str(info.value) == f"{config}: {FIX}"


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file of any mode")
def test_a_file_of_mode_000_is_named_as_unreadable(tmp_path):
    from symfuse.io.modes import check_readable

    file = tmp_path / "model.safetensors"
    file.write_bytes(b"\x00" * 16)
    file.chmod(0)
    with pytest.raises(CheckpointError, match="not readable by this user"):
        check_readable(file)
    with pytest.raises(CheckpointError, match="not readable by this user"):
        read_header(file)
