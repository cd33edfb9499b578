"""What a merge reads, checked and set up before the first tensor is merged (built by ``plan_merge``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from symfuse.merge.head_refit import RefitOptions
from symfuse.merge.readers import StreamingReader
from symfuse.stats.io import StatsFile


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

    @property
    def on_cpu(self) -> bool:
        """The CPU reads into reused buffers and fuses passes over spans; a device does not."""
        return self.device.type == "cpu"

    @property
    def learned(self) -> torch.Tensor | None:
        """``(K, classes)``: which classes each model learned (union heads), else None."""
        return self.union.learned if self.union is not None else None
