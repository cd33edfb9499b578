"""What a merge reads, checked and set up before the first tensor is merged (built by ``plan_merge``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from symfuse.merge.head_refit import RefitOptions
from symfuse.merge.readers import StreamingReader
from symfuse.merge.registry import OUT_DTYPE_NAMES
from symfuse.stats.io import StatsFile

OUT_DTYPES = {name: getattr(torch, name) for name in OUT_DTYPE_NAMES}


def out_dtype_of(value: str | torch.dtype | None) -> torch.dtype | None:
    """The output dtype named by ``value`` (``bfloat16``, ``torch.float16``, a ``torch.dtype``; None: as stored).

    Raises:
        ValueError: a name or dtype that is not one of :data:`OUT_DTYPES`.
    """
    if value is None or (isinstance(value, torch.dtype) and value in OUT_DTYPES.values()):
        return value
    name = value.removeprefix("torch.") if isinstance(value, str) else str(value)
    if name not in OUT_DTYPES:
        raise ValueError(f"out_dtype: {value!r} is not a floating dtype to write — give one of {', '.join(OUT_DTYPES)}")
    return OUT_DTYPES[name]


@dataclass
class MergePlan:
    """Everything a merge reads, checked before the first tensor is merged (:func:`plan_merge`).

    Attributes:
        strategy: The strategy's name.
        out: The output folder (for errors).
        merger: The strategy's merger (its ``pool`` and ``device`` set).
        readers: The K models.
        base_reader: The base model (task-vector strategies), else None.
        files: Statistics files by kind, one per model.
        weights: The K normalised model weights.
        heads: Model 0's tensors outside the base model.
        union: The union label space, or None.
        separate: Heads are kept per model (different label sets).
        names: Head folder of each model by its name (``.`` for the first).
        refit: Head refit options, or None; ``refit_data`` its batches.
        same_input: Gram keys whose module reads another's input in every model (one factorisation).
        device: Where the maths runs.
        out_dtype: The dtype the merged floating tensors are written in (None: the first model's).
    """

    strategy: str
    out: Path
    merger: Any
    readers: list[StreamingReader]
    base_reader: StreamingReader | None
    files: dict[str, list[StatsFile]]
    weights: list[float]
    heads: set[str]
    union: Any
    separate: bool
    names: dict[str, str]
    refit: RefitOptions | None
    refit_data: Any
    same_input: dict[str, str]
    device: torch.device
    out_dtype: torch.dtype | None = None

    @property
    def on_cpu(self) -> bool:
        """The CPU reads into reused buffers and fuses passes over spans; a device does not."""
        return self.device.type == "cpu"

    @property
    def learned(self) -> torch.Tensor | None:
        """``(K, classes)``: which classes each model learned (union heads), else None."""
        return self.union.learned if self.union is not None else None
