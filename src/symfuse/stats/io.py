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
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from symfuse.errors import CheckpointError, MissingStats, StatsMismatchError
from symfuse.io import BufferPool, TensorFile, save_safetensors

FORMAT_VERSION = "1"
STAT_KINDS = ("gram", "fisher")
# The one reader and buffer pool of the package (kept importable from here).
SafetensorsFile = TensorFile
__all__ = ["FORMAT_VERSION", "STAT_KINDS", "BufferPool", "SafetensorsFile", "StatsFile", "load_stats", "save_stats"]


def save_stats(tensors: Mapping[str, torch.Tensor], file: str | os.PathLike, meta: Mapping[str, Any]) -> Path:
    """Write a statistics file atomically (temp file + fsync + rename).

    Args:
        tensors: Statistic by key (module or parameter name).
        file: Destination ``.safetensors`` file.
        meta: Metadata; non-string values are JSON-encoded.

    Returns:
        The written file.
    """
    strmeta = {k: v if isinstance(v, str) else json.dumps(v) for k, v in meta.items()}
    strmeta.setdefault("format_version", FORMAT_VERSION)
    return save_safetensors(tensors, file, strmeta)


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
        try:
            self._f = SafetensorsFile(self.path)
        except CheckpointError as exc:  # the reader's fix is a checkpoint's (re-export with save_pretrained)
            what = str(exc).removeprefix(f"{self.path}: ").rsplit(" — ", 1)[0]
            raise StatsMismatchError(f"{self.path}: {what} — recollect it: symfuse stats MODEL --data DATA") from exc
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

    def dtype(self, key: str) -> torch.dtype:
        """Stored dtype of one statistic, without reading it."""
        return self._f.dtype(key)

    def read_span(self, key: str, out: torch.Tensor, first: int) -> torch.Tensor:
        """Fill the flat ``out`` (the stored dtype) with elements ``first:first + out.numel()`` of statistic ``key``."""
        return self._f.read_span(key, out, first)

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
