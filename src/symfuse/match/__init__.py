"""Matching: find the symmetry transforms that align a model to an anchor.

Importing this package does not import torch (the CLI plans an alignment with :mod:`symfuse.match.align` before
torch loads): the names below load their module on first access.
"""

from importlib import import_module
from typing import Any

_LAZY = {
    "REPORT_FILE": "symfuse.match.inputs",
    "TRANSFORMS_FILE": "symfuse.match.inputs",
    "assemble_matched": "symfuse.match.checkpoints",
    "load_transform": "symfuse.match.checkpoints",
    "match_checkpoints": "symfuse.match.checkpoints",
    "match_module": "symfuse.match.checkpoints",
    "save_transform": "symfuse.match.checkpoints",
    "align_checkpoints": "symfuse.match.align",
    "plan_alignment": "symfuse.match.align",
    "disguise_checkpoint": "symfuse.match.disguise",
    "match_many": "symfuse.match.many",
    "match_module_many": "symfuse.match.many",
    "DEFAULT_SYMMETRIES": "symfuse.match.weights",
    "SYMMETRIES": "symfuse.match.weights",
    "match_module_weights": "symfuse.match.weights",
    "ModuleTransform": "symfuse.symmetry.transforms",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "DEFAULT_SYMMETRIES",
    "REPORT_FILE",
    "SYMMETRIES",
    "TRANSFORMS_FILE",
    "ModuleTransform",
    "align_checkpoints",
    "assemble_matched",
    "disguise_checkpoint",
    "load_transform",
    "match_checkpoints",
    "match_many",
    "match_module",
    "match_module_many",
    "match_module_weights",
    "plan_alignment",
    "save_transform",
]
