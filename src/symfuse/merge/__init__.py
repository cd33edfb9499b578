"""Merge strategies, registered as plug-ins (:mod:`symfuse.merge.registry`).

The head policy is in :mod:`symfuse.merge.checkpoints`. Every merger class declares ``name``, ``required_stats``
(statistics kinds it reads), ``needs_base``, ``needs_data`` (RegMean++: it reads each model's dataset and collects
its statistics during the merge) and ``Params``. Importing this package does not import torch: the other
names load their module on first access.
"""

from importlib import import_module
from typing import Any

from symfuse.merge.registry import MERGERS, MergeParams, merger_params, register_merger, unregister_merger

_LAZY = {
    "LazyTensors": "symfuse.merge.base",
    "Merger": "symfuse.merge.base",
    "TensorInputs": "symfuse.merge.base",
    "weighted_mean": "symfuse.merge.base",
    "REPORT": "symfuse.merge.checkpoints",
    "StreamingReader": "symfuse.merge.checkpoints",
    "head_names": "symfuse.merge.checkpoints",
    "merge_checkpoints": "symfuse.merge.checkpoints",
    "RegMeanMerger": "symfuse.merge.regmean",
    "regmean_solve": "symfuse.merge.regmean",
    "RegMeanPlusPlusMerger": "symfuse.merge.regmean_plusplus_merger",
    "FisherMerger": "symfuse.merge.simple",
    "SimpleMerger": "symfuse.merge.simple",
    "DareMerger": "symfuse.merge.task_vectors",
    "TaskArithmeticMerger": "symfuse.merge.task_vectors",
    "TiesMerger": "symfuse.merge.task_vectors",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    "merger_params",
    "register_merger",
    "regmean_solve",
    "unregister_merger",
    "weighted_mean",
]
