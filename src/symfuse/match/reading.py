"""Reading module tensors into private memory with ``pread`` (no mmap): resident memory = live tensors.

:class:`symfuse.checkpoint.CheckpointReader` maps the safetensors files; every tensor of a file shares that
mapping, so the touched pages of a whole shard stay resident while any tensor from it (a LayerNorm weight waiting
in an output shard, say) is alive, and releasing one module's tensors frees nothing until the last reference
goes. Matching and writing 7B-width models module by module need the opposite: a tensor's bytes are freed when
the tensor is. :class:`PreadSource` reads exactly the requested tensors' bytes into fresh tensors (one ``preadv``
system call from the page cache, no page-fault per 4 KiB) and shares no state between calls, so threads can use
it concurrently.
"""

from __future__ import annotations

import torch

from symfuse.arch import ModuleRef, ModuleWeights
from symfuse.checkpoint import CheckpointReader


class PreadSource:
    """Tensors of a checkpoint read with ``preadv`` into private memory (see the module docstring).

    The reader's validated :class:`~symfuse.io.TensorFile` objects do the reading (no second header parse).

    Args:
        reader: The open checkpoint (gives folder, spec, config, prefix and the validated weight files).
    """

    def __init__(self, reader: CheckpointReader):
        self.reader = reader

    def has(self, name: str) -> bool:
        """Whether the checkpoint stores ``name``."""
        return self.reader.has(name)

    def get(self, name: str) -> torch.Tensor:
        """A new tensor holding the stored bytes of ``name`` (no mapping is kept).

        Raises:
            CheckpointError: absent tensor or a truncated file.
        """
        return self.reader.tensor_file(name).get(name)

    def get_rows(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Rows ``lo:hi`` (first axis) of a stored tensor, reading only their bytes."""
        return self.reader.tensor_file(name).get_rows(name, lo, hi)

    def meta(self, name: str) -> tuple[torch.dtype, list[int]]:
        """Stored dtype and shape of a tensor."""
        info = self.reader.tensor_file(name).info(name)
        return info.dtype, list(info.shape)

    def read_module(self, ref: ModuleRef) -> ModuleWeights:
        """One module's canonical weights (see :meth:`CheckpointReader.read_module`; no finiteness check)."""
        r = self.reader
        return r.spec.read_module(self.get, self.has, ref, r.config, r.prefix)

    def close(self) -> None:
        """Close the file descriptors (reopened on the next read)."""
        for tf in self.reader.tensor_files.values():
            tf.close()

    def __enter__(self) -> PreadSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
