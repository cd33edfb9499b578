"""The ``regmean++`` merger plug-in: RegMean++ with its statistics collected on the partially merged model.

Unlike RegMean it reads no stored statistics: layer ``l``'s Grams depend on the merged layers ``0 .. l-1``, so they
are collected during the merge (:func:`symfuse.merge.sequential.regmean_plusplus_state`). It needs, per model,
the dataset its Grams come from (``data``, one per model, in model order: each model's own training data) and
runs forward passes on ``device``. :meth:`RegMeanPlusPlusMerger.prepare` (called by
:func:`symfuse.merge.checkpoints.merge_checkpoints` once the inputs are checked) does the whole merge;
:meth:`~RegMeanPlusPlusMerger.merge_tensor` then hands out its tensors.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar, Literal

import torch
from pydantic import Field

from symfuse.errors import MissingStats
from symfuse.merge.base import MergeParams, Merger, TensorInputs, weighted_mean
from symfuse.merge.regmean import regmean_solve
from symfuse.seeds import Seed

log = logging.getLogger(__name__)


class RegMeanPlusPlusParams(MergeParams):
    """RegMean++ parameters: RegMean's, and where its Grams come from."""

    alpha: float = Field(default=0.9, ge=0, le=1)  # off-diagonal scale of each Gram
    dtype: Literal["float64", "float32"] = "float64"  # solve precision
    data: list[str] = Field(default_factory=list)  # one dataset per model, in model order (its own training data)
    split: str = "train"
    max_examples: int | None = Field(default=256, gt=0)  # seeded subset of each dataset (None: all of it)
    batch_size: int = Field(default=16, gt=0)
    max_length: int = Field(default=128, gt=0)
    seed: Seed = 13
    device: str = "cpu"


class RegMeanPlusPlusMerger(Merger):
    """RegMean++ (Nguyen et al., 2025): every layer's Grams on the merged model's own earlier layers."""

    name = "regmean++"
    needs_data: ClassVar[bool] = True  # reads the models' datasets (``data``) instead of statistics files
    # in the pipeline: each model's dataset, the statistics stage's sampling settings and the run's device
    run_params: ClassVar[tuple[str, ...]] = ("data", "max_examples", "batch_size", "max_length", "seed", "device")
    Params = RegMeanPlusPlusParams

    def __init__(self, **params):
        super().__init__(**params)
        self._merged: dict[str, torch.Tensor] | None = None
        self._tail_grams: dict[str, list[torch.Tensor]] = {}

    def prepare(self, models: Sequence[Path], keep: frozenset[str] = frozenset()) -> None:
        """Load the K checkpoints and their data, and merge them all (the statistics stage and the solves).

        Args:
            models: The K checkpoint folders (checked by the caller).
            keep: Tensor names kept per model (per-dataset heads): not merged.

        Raises:
            MissingStats: ``data`` does not name one dataset per model.
            DataError: a dataset cannot be loaded.
        """
        from symfuse.checkpoint import load_hf_model
        from symfuse.data import batches_per_model
        from symfuse.merge.sequential import regmean_plusplus_state

        p = self.params
        data: list[str] = p.data  # type: ignore[attr-defined]
        if len(data) != len(models):
            raise MissingStats(
                f"regmean++ collects its Grams on each model's data: {len(data)} dataset(s) for {len(models)} "
                "models — give one per model, in order (--data)"
            )
        loaders = batches_per_model(data, models, p.split, p.batch_size, p.max_length, p.max_examples, p.seed)  # type: ignore[attr-defined]
        nets = [load_hf_model(m, validate=False) for m in models]
        self._tail_grams = {}
        self._merged = regmean_plusplus_state(
            nets, loaders, self.model_weights(len(models)), p.alpha, keep,  # type: ignore[attr-defined]
            device=p.device, dtype=getattr(torch, p.dtype), tail_grams=self._tail_grams,  # type: ignore[attr-defined]
        )  # fmt: skip
        self.counters["models_run"] = len(nets)
        del nets

    def supplied_grams(self, module: str) -> list[torch.Tensor] | None:
        """The K Grams :meth:`prepare` collected for a linear layer after the stack (on the merged body), else None."""
        return self._tail_grams.get(module)

    def merge_tensor(self, t: TensorInputs) -> torch.Tensor:
        """The tensor RegMean++ merged in :meth:`prepare`, in the checkpoint's dtype.

        A linear layer after the stack comes with the Grams of :meth:`supplied_grams` (``t.gram``): it is solved
        here, so a caller may merge it over a subset of the models or of its rows (union heads, class by class);
        over all K models this is the solve :meth:`prepare` made. A stored tensor the loaded model does not hold (a
        tied copy), and a part of a tensor without Grams (a union head's bias rows over their learners), get the
        weighted mean, as in RegMean.
        """
        if self._merged is None:
            raise RuntimeError("regmean++: prepare() was not called before merge_tensor()")
        if t.gram is not None:
            p = self.params
            out, _ = regmean_solve(t.tensors, t.gram, t.weights, p.alpha, conv1d=t.conv1d,  # type: ignore[attr-defined]
                                   dtype=getattr(torch, p.dtype))  # type: ignore[attr-defined]  # fmt: skip
            self.count("regmean_solves")
            return out
        got = None if t.part else self._merged.get(t.name)
        if got is None:  # a tied copy, or some rows over their learners (union head bias): RegMean's weighted mean
            self.count("weighted_mean")
            return weighted_mean(t.tensors, t.weights)
        self.count("regmean_plusplus_tensors")
        return got.to(t.tensors[0].dtype)
