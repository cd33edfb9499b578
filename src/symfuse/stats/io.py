"""Statistics files: one safetensors file per (model, dataset, kind).

Format (read by tools outside the package, so it is kept simple):

* ``gram.safetensors``: key = linear module name as in the model (``bert.encoder.layer.0.attention.self.query``,
  GPT-2 ``transformer.h.0.attn.c_attn``), tensor ``(in_features, in_features)`` float64 holding the MEAN
  ``X^T X / n`` over the module's input rows (non-padding tokens for token-level layers, examples for pooled heads).
* ``fisher.safetensors``: key = parameter name (as in ``model.safetensors``), tensor of the parameter's shape
  (float32) holding the mean over examples of the squared per-example gradient of the log-likelihood.
* Metadata (safetensors ``__metadata__``, all strings): ``kind``, ``n_tokens``, ``n_examples``,
  ``dataset_fingerprint``, ``model_fingerprint``, ``format_version`` and, as JSON, ``rows`` (gram: input rows
  per module), ``conv1d`` (gram: modules stored as GPT-2 ``Conv1D``, weight layout (in, out)) and
  ``same_input`` (gram, optional: key -> the first key whose module reads the very same input tensor, e.g.
  ``...key`` / ``...value`` -> ``...query``; their Grams are identical, every key is still stored); Fisher adds
  ``fisher_mode`` (``empirical`` | ``sampled``).
* Readers accept any float dtype (the merge converts once per tensor); the package writes float64 Grams.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from symfuse.errors import MissingStats

FORMAT_VERSION = "1"
STAT_KINDS = ("gram", "fisher")
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class SafetensorsFile:
    """Reads tensors of a safetensors file with plain ``read`` calls, one tensor at a time.

    Unlike ``safe_open`` (mmap), the pages read stay in the page cache, not in this process's resident set,
    so a merge that streams K models' tensors keeps its RSS at the size of the tensors it holds.

    Args:
        file: A ``.safetensors`` file.
    """

    def __init__(self, file: str | os.PathLike):
        self.path = Path(file)
        with open(self.path, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        self._data_start = 8 + n
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self.header: dict[str, dict[str, Any]] = header

    def keys(self) -> list[str]:
        """Tensor names in the file."""
        return list(self.header)

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of one tensor, without reading it."""
        return tuple(self.header[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        """Stored dtype of one tensor, without reading it."""
        return _DTYPES[self.header[name]["dtype"]]

    def get(self, name: str, pool: BufferPool | None = None, slot: str = "") -> torch.Tensor:
        """Read one tensor into a new CPU tensor, or into ``pool``'s buffer ``slot`` (reused: see BufferPool).

        Reads with ``os.preadv`` (no shared file position), so several threads may read the same file.
        """
        info = self.header[name]
        start, end = info["data_offsets"]
        dtype, shape = _DTYPES[info["dtype"]], info["shape"]
        out = pool.take(slot or "read", shape, dtype) if pool is not None else torch.empty(shape, dtype=dtype)
        view = memoryview(out.view(-1).view(torch.uint8).numpy()) if out.numel() else memoryview(b"")
        fd = os.open(self.path, os.O_RDONLY)
        try:
            pos, offset = 0, self._data_start + start
            while pos < end - start:
                n = os.preadv(fd, [view[pos:]], offset + pos)
                if n <= 0:
                    raise OSError(f"{self.path}: file ends inside tensor {name!r}; the file is truncated")
                pos += n
        finally:
            os.close(fd)
        return out


class BufferPool:
    """Reusable CPU buffers by slot name, so that streaming loops do not allocate (and page-fault) every tensor.

    Freshly allocated large tensors cost about as much CPU time in page faults as reading them from the page
    cache; a loop that reads K models' tensors one after another into the same slot touches its memory once.
    A tensor taken from a slot is valid until the slot is taken again.
    """

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}

    def take(self, slot: str, shape: tuple[int, ...] | list[int] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A tensor of ``shape`` and ``dtype`` backed by slot ``slot`` (contents undefined)."""
        numel = 1
        for n in shape:
            numel *= int(n)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        buf = self._bufs.get(slot)
        if buf is None or buf.numel() < nbytes:
            buf = self._bufs[slot] = torch.empty(max(nbytes, 64), dtype=torch.uint8)
        return buf[:nbytes].view(dtype).view(tuple(shape))

    def swap(self, a: str, b: str) -> None:
        """Exchange the buffers of two slots (tensors taken from them keep their memory)."""
        self._bufs[a], self._bufs[b] = self._bufs.pop(b, None), self._bufs.pop(a, None)  # type: ignore[assignment]
        for k in (a, b):
            if self._bufs[k] is None:
                del self._bufs[k]

    def nbytes(self) -> int:
        """Bytes held by every slot."""
        return sum(b.numel() for b in self._bufs.values())

    def clear(self) -> None:
        """Drop every buffer."""
        self._bufs.clear()


def save_stats(tensors: Mapping[str, torch.Tensor], file: str | os.PathLike, meta: Mapping[str, Any]) -> Path:
    """Write a statistics file atomically (temp file + rename).

    Args:
        tensors: Statistic by key (module or parameter name).
        file: Destination ``.safetensors`` file.
        meta: Metadata; non-string values are JSON-encoded.

    Returns:
        The written file.
    """
    file = Path(file)
    file.parent.mkdir(parents=True, exist_ok=True)
    strmeta = {k: v if isinstance(v, str) else json.dumps(v) for k, v in meta.items()}
    strmeta.setdefault("format_version", FORMAT_VERSION)
    fd, tmp = tempfile.mkstemp(prefix=f".{file.name}.", dir=file.parent)
    os.close(fd)
    try:
        save_file({k: v.detach().contiguous() for k, v in tensors.items()}, tmp, metadata=strmeta)
        os.replace(tmp, file)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return file


class StatsFile:
    """Lazy reader of one statistics file: tensors are loaded one key at a time.

    Args:
        file: A file written by :func:`save_stats`.

    Attributes:
        path: The file.
        meta: Decoded metadata (JSON values decoded, numbers as int where they parse).
        kind: ``gram`` or ``fisher``.
    """

    def __init__(self, file: str | os.PathLike):
        self.path = Path(file)
        if not self.path.is_file():
            raise MissingStats(f"{self.path}: statistics file not found; run `symfuse stats` first")
        self._f = SafetensorsFile(self.path)
        self._keys = set(self._f.keys())
        raw = self._f.metadata
        self.meta: dict[str, Any] = {}
        for k, v in raw.items():
            try:
                self.meta[k] = json.loads(v)
            except (json.JSONDecodeError, TypeError):
                self.meta[k] = v
        self.kind = str(self.meta.get("kind", ""))

    def keys(self) -> list[str]:
        """Every stored key."""
        return sorted(self._keys)

    def has(self, key: str) -> bool:
        """Whether a key is stored."""
        return key in self._keys

    def get(self, key: str, pool: BufferPool | None = None, slot: str = "") -> torch.Tensor:
        """Load one statistic (into ``pool``'s buffer ``slot`` when given, see :class:`BufferPool`).

        Raises:
            MissingStats: if the key is absent.
        """
        if key not in self._keys:
            raise MissingStats(f"{self.path}: no {self.kind or 'statistic'} for {key!r}; recollect the statistics")
        return self._f.get(key, pool, slot)

    def shape(self, key: str) -> tuple[int, ...]:
        """Shape of one statistic, without reading it."""
        return self._f.shape(key)

    @property
    def same_input(self) -> dict[str, str]:
        """Gram key -> the first key whose module reads the same input tensor (identical Gram), when recorded."""
        return {str(k): str(v) for k, v in (self.meta.get("same_input") or {}).items() if k in self._keys}

    @property
    def conv1d(self) -> set[str]:
        """Gram keys whose module stores its weight as (in, out) (GPT-2 ``Conv1D``)."""
        return set(self.meta.get("conv1d", []) or [])


def load_stats(file: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Load a whole statistics file: ``(tensors, metadata)``."""
    sf = StatsFile(file)
    tensors = {k: sf.get(k) for k in sf.keys()}  # noqa: SIM118
    return tensors, sf.meta


def file_fingerprint(*files: str | os.PathLike, extra: str = "") -> str:
    """SHA-256 (first 16 hex digits) of files' bytes and an extra string."""
    h = hashlib.sha256()
    for f in files:
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
    h.update(extra.encode())
    return h.hexdigest()[:16]
