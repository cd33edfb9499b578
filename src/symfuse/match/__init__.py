"""Matching: find the symmetry transforms that align a model to an anchor."""

from symfuse.match.checkpoints import (
    REPORT_FILE,
    TRANSFORMS_FILE,
    assemble_matched,
    load_transform,
    match_checkpoints,
    match_module,
    save_transform,
)
from symfuse.match.disguise import disguise_checkpoint
from symfuse.match.many import match_many, match_module_many
from symfuse.match.weights import DEFAULT_SYMMETRIES, SYMMETRIES, match_module_weights
from symfuse.symmetry.transforms import ModuleTransform

__all__ = [
    "DEFAULT_SYMMETRIES",
    "REPORT_FILE",
    "SYMMETRIES",
    "TRANSFORMS_FILE",
    "ModuleTransform",
    "assemble_matched",
    "disguise_checkpoint",
    "load_transform",
    "match_checkpoints",
    "match_many",
    "match_module",
    "match_module_many",
    "match_module_weights",
    "save_transform",
]
