"""Run ``symfuse`` as a real subprocess (real exit codes, stderr and signals) and build bad inputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import symfuse

SRC = Path(symfuse.__file__).resolve().parents[1]
ROOT = Path(__file__).resolve().parents[2]


def cli_env() -> dict[str, str]:
    """The environment for a ``symfuse`` subprocess: this checkout first on the path, offline hub."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), str(ROOT), env.get("PYTHONPATH", "")])
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", COLUMNS="200")
    return env


def cli_command(*args: object, module: str = "symfuse.cli") -> list[str]:
    """``python -m symfuse.cli ARGS`` (or another module, e.g. the pausing wrapper)."""
    return [sys.executable, "-m", module, *map(str, args)]


def run_cli(*args: object, cwd: Path | None = None, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """Run ``symfuse ARGS`` to completion."""
    return subprocess.run(
        cli_command(*args), cwd=cwd, env=cli_env(), capture_output=True, text=True, timeout=timeout, check=False
    )


def toy_dataset(folder: Path, labels: tuple[str, ...] = ("anger", "joy")) -> Path:
    """A tiny classification dataset over ``labels`` (JSONL splits of 8 rows + meta.json)."""
    folder.mkdir(parents=True, exist_ok=True)
    words = ["happy", "angry", "calm", "sad"]
    rows = [{"text": f"i feel so {words[i % 4]} today", "label": labels[i % len(labels)]} for i in range(8)]
    for split in ("train", "validation", "test"):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "meta.json").write_text(json.dumps({"task": "classification", "labels": sorted(labels)}))
    return folder


def listing(folder: Path) -> dict[str, bytes | None]:
    """Every path under ``folder`` (hidden ones included) with its bytes (None for folders)."""
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None) for p in sorted(folder.rglob("*"))}


def assert_merge_refused(tmp_path: Path, strategy: str, args: str, code: int, expect: str) -> None:
    """``symfuse merge --strategy S ARGS --out tmp_path/out`` on two tiny BERTs and a toy dataset fails in one line.

    ``args`` may name ``{A}``, ``{B}`` (the models) and ``{DATA}``. The exit code is ``code``, the last stderr line
    is ``error: ...`` holding ``expect`` (an INFO line of a dataset loaded before it may precede it), there is no
    traceback, and nothing under ``tmp_path`` changed.
    """
    from tests.tiny import save_tiny

    paths = {"A": save_tiny(tmp_path / "a", "bert", seed=1), "B": save_tiny(tmp_path / "b", "bert", seed=2)}
    paths["DATA"] = toy_dataset(tmp_path / "toy")
    before = listing(tmp_path)
    res = run_cli("merge", "--strategy", strategy, *args.format(**paths).split(), "--out", tmp_path / "out",
                  cwd=tmp_path)  # fmt: skip
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == code, res.stderr
    assert 1 <= len(lines) <= 2 and lines[-1].startswith("error: ") and expect in lines[-1], res.stderr
    assert "Traceback" not in res.stderr and listing(tmp_path) == before


def run_on_terminal(*args: object, columns: int = 120, timeout: float = 300) -> tuple[int, str]:
    """Run ``symfuse ARGS`` with stderr on a pseudo-terminal ``columns`` wide: ``(exit status, what it showed)``."""
    import fcntl
    import pty
    import struct
    import termios

    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    proc = subprocess.Popen(cli_command(*args), env=cli_env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=child)  # fmt: skip
    os.close(child)
    chunks = []
    while True:
        try:
            chunk = os.read(main, 4096)
        except OSError:  # the terminal closed: the command ended
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(main)
    return proc.wait(timeout=timeout), b"".join(chunks).decode(errors="replace")
