"""Readers of the models a merge reads: plain reads (no mmap), and tied LM heads read under their own name."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from symfuse.checkpoint import CheckpointReader
from symfuse.io import BufferPool
from symfuse.symmetry.residual_orthogonal import tied_heads


class StreamingReader(CheckpointReader):
    """A :class:`CheckpointReader` that reads each tensor with plain reads instead of mmap.

    :meth:`untie` makes a tied LM head readable under its own name (it reads the embedding it is tied to).
    """

    def __init__(self, path_or_id: str | os.PathLike):
        super().__init__(path_or_id)
        self.aliases: dict[str, str] = {}

    def untie(self, head: str, embedding: str) -> None:
        """Read ``head`` (stored tied, as ``embedding``) as a tensor of its own."""
        self.aliases[head] = embedding
        self._files[head] = self._files[embedding]

    def tensor_file(self, name: str) -> Any:
        """The file holding ``name`` (an untied head: its embedding's file, read under the head's name)."""
        real = self.aliases.get(name)
        return super().tensor_file(name) if real is None else Renamed(super().tensor_file(real), name, real)

    def get(self, name: str, pool: BufferPool | None = None, slot: str = "") -> torch.Tensor:
        """Load one tensor into new memory, or into ``pool``'s ``slot`` (see :class:`symfuse.io.TensorFile`)."""
        return self.tensor_file(name).get(name, pool, slot)


class Renamed:
    """A tensor file read under another name: ``name`` is the stored tensor ``real`` (a tied LM head)."""

    def __init__(self, file: Any, name: str, real: str) -> None:
        self.file, self.name, self.real, self.path = file, name, real, file.path

    def _real(self, name: str) -> str:
        return self.real if name == self.name else name

    def info(self, name: str) -> Any:
        """The stored tensor's info."""
        return self.file.info(self._real(name))

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored tensor's shape."""
        return self.file.shape(self._real(name))

    def dtype(self, name: str) -> torch.dtype:
        """The stored tensor's dtype."""
        return self.file.dtype(self._real(name))

    def read_span(self, name: str, out: torch.Tensor, first: int) -> torch.Tensor:
        """Elements ``first:`` of the stored tensor into ``out``."""
        return self.file.read_span(self._real(name), out, first)

    def get(self, name: str, pool: BufferPool | None = None, slot: str = "") -> torch.Tensor:
        """The stored tensor."""
        return self.file.get(self._real(name), pool, slot)


def untie_mixed(readers: Sequence[StreamingReader]) -> bool:
    """Where some models store their LM head and others tie it to the embedding, read the tied ones' heads untied.

    (A model aligned by ``residual-orthogonal`` may carry its own head while its anchor ties it.) Returns whether
    any was untied: the merged model then stores its own head (``tie_word_embeddings: false``).
    """
    ties = [tied_heads(r.spec, dict.fromkeys(r.names()), r.config, r.prefix) for r in readers]
    stored = {h for t in ties for h in t if any(r.has(h) for r in readers)}  # a head some model stores
    untied = False
    for r, t in zip(readers, ties, strict=True):
        for head in stored:
            if head in t and not r.has(head):
                r.untie(head, t[head])
                untied = True
    return untied


def counterpart(name: str, src: CheckpointReader, dst: CheckpointReader) -> str:
    """``src``'s tensor ``name`` as ``dst`` spells it (a classifier's ``bert.`` prefix where a bare base has none)."""
    return dst.prefix + name[len(src.prefix) :] if name.startswith(src.prefix) else name
