"""Merge strategies, registered as plug-ins (see :mod:`symfuse.merge.checkpoints` for the head policy).

Every merger class declares ``name``, ``required_stats`` (statistics kinds it reads), ``needs_base`` and
``needs_data`` (RegMean++: it reads each model's dataset and collects its statistics during the merge).
"""

from symfuse.merge.base import LazyTensors, MergeParams, Merger, TensorInputs, weighted_mean
from symfuse.merge.checkpoints import REPORT, StreamingReader, head_names, merge_checkpoints
from symfuse.merge.regmean import RegMeanMerger, regmean_solve
from symfuse.merge.regmean_plusplus_merger import RegMeanPlusPlusMerger
from symfuse.merge.simple import FisherMerger, SimpleMerger
from symfuse.merge.task_vectors import DareMerger, TaskArithmeticMerger, TiesMerger

MERGERS: dict[str, type[Merger]] = {
    m.name: m
    for m in (SimpleMerger, FisherMerger, RegMeanMerger, RegMeanPlusPlusMerger, TaskArithmeticMerger, TiesMerger,
              DareMerger)
}  # fmt: skip

__all__ = [
    "MERGERS",
    "REPORT",
    "DareMerger",
    "FisherMerger",
    "LazyTensors",
    "MergeParams",
    "Merger",
    "RegMeanMerger",
    "RegMeanPlusPlusMerger",
    "SimpleMerger",
    "StreamingReader",
    "TaskArithmeticMerger",
    "TensorInputs",
    "TiesMerger",
    "head_names",
    "merge_checkpoints",
    "regmean_solve",
    "weighted_mean",
]
