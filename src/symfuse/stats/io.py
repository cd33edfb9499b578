"""Statistics files: one safetensors file per (model, dataset, kind).

Format (read by tools outside the package, so it is kept simple):

* ``gram.safetensors``: key = linear module name as in the model (``bert.encoder.layer.0.attention.self.query``,
  GPT-2 ``transformer.h.0.attn.c_attn``), tensor ``(in_features, in_features)`` float64 holding the MEAN
  ``X^T X / n`` over the module's input rows (non-padding tokens for token-level layers, examples for pooled heads).
* ``fisher.safetensors``: key = parameter name (as in ``model.safetensors``), tensor of the parameter's shape
  (float32) holding the mean over examples of the squared per-example gradient of the log-likelihood.
* Metadata (safetensors ``__metadata__``, all strings): ``kind``, ``n_tokens``, ``n_examples``,
  ``dataset_fingerprint``, ``model_fingerprint``, ``format_version`` and, as JSON, ``rows`` (gram: input rows
  per module) and ``conv1d`` (gram: modules stored as GPT-2 ``Conv1D``, weight layout (in, out)); Fisher adds
  ``fisher_mode`` (``empirical`` | ``sampled``).
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

    def get(self, name: str) -> torch.Tensor:
        """Read one tensor into a new CPU tensor."""
        info = self.header[name]
        start, end = info["data_offsets"]
        buf = torch.empty(end - start, dtype=torch.uint8)
        with open(self.path, "rb") as fh:
            fh.seek(self._data_start + start)
            fh.readinto(memoryview(buf.numpy()))
        return buf.view(_DTYPES[info["dtype"]]).reshape(info["shape"])


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

    def get(self, key: str) -> torch.Tensor:
        """Load one statistic.

        Raises:
            MissingStats: if the key is absent.
        """
        if key not in self._keys:
            raise MissingStats(f"{self.path}: no {self.kind or 'statistic'} for {key!r}; recollect the statistics")
        return self._f.get(key)

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
