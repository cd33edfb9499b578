"""Safetensors files whose layout is planned up front and filled tensor by tensor (``pwrite``), from any thread.

When every tensor's name, dtype and shape are known before any value is (a checkpoint rewritten with the same
tensors, e.g. a matched model), the header can be written first and each tensor stored at its offset the moment
it is ready: nothing waits in memory for its shard to fill. The bytes are exactly those
``safetensors.torch.save_file`` writes for the same tensors (same header JSON, tensor order and padding).

The files are written where the caller says (a temporary folder that is renamed into place when everything
succeeded, see :func:`symfuse.outputs.atomic_output_dir`); a file is fsynced by the thread that writes its last
tensor, and :meth:`PlannedFile.finish` refuses a file with a tensor missing. Write errors name the file.
Writes are plain buffered ``pwrite`` calls in the calling thread.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from symfuse.errors import CheckpointError
from symfuse.io.folder import WEIGHTS, WEIGHTS_INDEX
from symfuse.io.safetensors import DTYPES, write_error

_NAMES = {v: k for k, v in DTYPES.items()}
# safetensors writes tensors by dtype (this order: its Rust enum, largest first), then by name
_RANK = {
    n: i
    for i, n in enumerate(("I64", "F64", "F32", "I32", "BF16", "F16", "I16", "F8_E4M3", "F8_E5M2", "I8", "U8", "BOOL"))
}


def _nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    n = torch.empty((), dtype=dtype).element_size()
    for s in shape:
        n *= int(s)
    return n


class PlannedFile:
    """One safetensors file with a fixed set of tensors, written in any order with ``pwrite``.

    Args:
        file: Destination (created or truncated; its size is set at once).
        layout: ``{name: (dtype, shape)}`` of every tensor the file will hold.
        metadata: String metadata (``__metadata__``).
    """

    def __init__(
        self,
        file: str | os.PathLike,
        layout: Mapping[str, tuple[torch.dtype, Sequence[int]]],
        metadata: Mapping[str, str] | None = None,
    ):
        self.path = Path(file)
        order = sorted(layout, key=lambda n: (_RANK[_NAMES[layout[n][0]]], n.encode()))
        head: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
        self._slots: dict[str, tuple[int, int, torch.dtype, tuple[int, ...]]] = {}
        pos = 0
        for n in order:
            dtype, shape = layout[n]
            size = _nbytes(dtype, shape)
            head[n] = {"dtype": _NAMES[dtype], "shape": [int(s) for s in shape], "data_offsets": [pos, pos + size]}
            self._slots[n] = (pos, size, dtype, tuple(int(s) for s in shape))
            pos += size
        text = json.dumps(head, separators=(",", ":"), ensure_ascii=False).encode()
        text += b" " * (-len(text) % 8)
        self._data = 8 + len(text)
        self.size = self._data + pos
        self._missing = {n for n in layout if self._slots[n][1]}  # empty tensors need no write
        self._written: dict[str, int] = {}
        self._synced = False
        self._lock = threading.Lock()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(self._fd, self.size)
        self._pwrite(struct.pack("<Q", len(text)) + text, 0)

    def _pwrite(self, data: memoryview | bytes, offset: int) -> None:
        view = memoryview(data).cast("B")
        try:
            while view:
                done = os.pwrite(self._fd, view, offset)
                view, offset = view[done:], offset + done
        except OSError as exc:  # pwrite's errors name no file
            raise write_error(self.path, exc.errno, exc.strerror) from exc

    def write(self, name: str, tensor: torch.Tensor, first_row: int = 0) -> None:
        """Store ``tensor`` (all of ``name``, or its rows from ``first_row`` on) at its place in the file.

        Raises:
            CheckpointError: an unknown name, a dtype / shape other than planned, or rows past the end.
        """
        if name not in self._slots:
            raise CheckpointError(f"{self.path}: {name!r} is not one of the planned tensors")
        begin, size, dtype, shape = self._slots[name]
        t = tensor.detach().contiguous()
        rows = t.shape[0] if t.dim() else 1
        if (
            t.dtype != dtype
            or t.dim() != len(shape)
            or tuple(t.shape[1:]) != shape[1:]
            or first_row + rows > (shape[0] if shape else 1)
        ):
            raise CheckpointError(
                f"{self.path}: {name!r} rows {first_row}: is {t.dtype} {tuple(t.shape)}, planned {dtype} {shape}"
            )
        nbytes = t.numel() * t.element_size()
        if nbytes:
            offset = begin + (first_row * (size // shape[0]) if shape else 0)
            self._pwrite(memoryview(t.reshape(-1).view(torch.uint8).numpy()), self._data + offset)
        with self._lock:
            self._written[name] = self._written.get(name, 0) + nbytes
            if self._written[name] >= size:
                self._missing.discard(name)
            complete = not self._missing and not self._synced
            self._synced = self._synced or complete
        if complete:  # the last tensor: flush now, in the writing thread, not in finish()
            self._fsync()

    def _fsync(self) -> None:
        try:
            os.fsync(self._fd)
        except OSError as exc:  # fsync's errors name no file either
            raise write_error(self.path, exc.errno, exc.strerror) from exc

    def finish(self) -> Path:
        """Check every tensor was written (the last rows of each), fsync and close the file.

        Raises:
            CheckpointError: a planned tensor was never written.
        """
        if self._missing:
            raise CheckpointError(f"{self.path}: tensors never written: {sorted(self._missing)[:5]}")
        if not self._synced:
            self._fsync()
        self.close()
        return self.path

    def close(self) -> None:
        """Close the descriptor (idempotent; the file stays as written so far)."""
        if not hasattr(self, "_fd"):  # the constructor failed before opening it
            return
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def __del__(self) -> None:
        self.close()


def stored_dtype(stored: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a copy writes a tensor stored as ``stored`` in: ``dtype`` for floating tensors, else unchanged."""
    return dtype if dtype is not None and stored.is_floating_point else stored


def plan_shards(reader: Any, shard_bytes: int, dtype: torch.dtype | None = None) -> list[list[str]]:
    """Tensor names per output shard of a copy of ``reader``, in storage order, each shard at most ``shard_bytes``.

    ``reader`` is a :class:`symfuse.checkpoint.CheckpointReader` (its ``names()`` and ``tensor_file(name)``);
    ``dtype``: floating tensors are written in it (None: as stored).
    """
    shards: list[list[str]] = [[]]
    size = 0
    for name in reader.names():
        info = reader.tensor_file(name).info(name)
        nbytes = _nbytes(stored_dtype(info.dtype, dtype), info.shape)
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


class PlannedCheckpoint:
    """The weight files of a copy of ``reader`` (same tensors, in their dtypes or ``dtype``), filled in any order.

    One shard is ``model.safetensors``; several are ``model-00000.safetensors`` ... plus the index, written by
    :meth:`finish`. Config and tokenizer files are the caller's (:func:`symfuse.checkpoint.copy_side_files`).

    Args:
        reader: The checkpoint copied (a :class:`symfuse.checkpoint.CheckpointReader`).
        out: Folder to write into (a temporary folder the caller publishes).
        shard_bytes: Largest shard size.
        dtype: Write the floating tensors in this dtype (None: each in its stored dtype).
    """

    def __init__(self, reader: Any, out: Path, shard_bytes: int, dtype: torch.dtype | None = None):
        self.out = out
        self.shards = plan_shards(reader, shard_bytes, dtype)
        single = len(self.shards) == 1
        self.files: list[PlannedFile] = []
        self.file_of: dict[str, PlannedFile] = {}
        self.dtype: dict[str, torch.dtype] = {}
        try:
            for i, names in enumerate(self.shards):
                layout = {}
                for n in names:
                    info = reader.tensor_file(n).info(n)
                    self.dtype[n] = stored_dtype(info.dtype, dtype)
                    layout[n] = (self.dtype[n], info.shape)
                name = WEIGHTS if single else f"model-{i:05d}.safetensors"
                pf = PlannedFile(out / name, layout, {"format": "pt"})
                self.files.append(pf)
                self.file_of.update(dict.fromkeys(names, pf))
        except BaseException:
            self.close()
            raise

    def write(self, name: str, tensor: torch.Tensor, first_row: int = 0) -> None:
        """Store (rows of) one tensor, converted to its stored dtype."""
        self.file_of[name].write(name, tensor.to(self.dtype[name]), first_row)

    def finish(self) -> None:
        """Check and flush every shard to disk; write the index (several shards)."""
        for f in self.files:
            f.finish()
        if len(self.files) > 1:
            weight_map = {n: f"model-{i:05d}.safetensors" for i, names in enumerate(self.shards) for n in names}
            total = sum(f.size for f in self.files)
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (self.out / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2))

    def close(self) -> None:
        """Close every file (after an error; idempotent)."""
        for f in self.files:
            f.close()
