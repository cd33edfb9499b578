"""Exact symmetry transforms (value objects acting on module weights and on statistics) and the kinds' registry.

Importing this package does not import torch (:mod:`symfuse.symmetry.registry` is read by the CLI and the config
before torch loads): the other names load their module on first access.
"""

from importlib import import_module
from typing import Any

from symfuse.symmetry.registry import (
    SYMMETRY_KINDS,
    SymmetryKind,
    check_kinds,
    kind_names,
    register_kind,
    unregister_kind,
)

_LAZY = {
    "ALL_KINDS": "symfuse.symmetry.random",
    "random_module_transform": "symfuse.symmetry.random",
    "random_orthogonal": "symfuse.symmetry.random",
    "rope_rotation": "symfuse.symmetry.random",
    "FFNPermutation": "symfuse.symmetry.transforms",
    "HeadPermutation": "symfuse.symmetry.transforms",
    "ModuleTransform": "symfuse.symmetry.transforms",
    "QKLinear": "symfuse.symmetry.head_linear",
    "QKRotation": "symfuse.symmetry.transforms",
    "QKScaling": "symfuse.symmetry.transforms",
    "Transform": "symfuse.symmetry.transforms",
    "VOLinear": "symfuse.symmetry.head_linear",
    "VORotation": "symfuse.symmetry.transforms",
    "VOScaling": "symfuse.symmetry.transforms",
    "load_transforms": "symfuse.symmetry.transforms",
    "register_transform": "symfuse.symmetry.transforms",
    "save_transforms": "symfuse.symmetry.transforms",
    "FFNTransport": "symfuse.symmetry.transport",  # soft OT maps (symfuse.match.ot)
    "HeadTransport": "symfuse.symmetry.transport",
    "ResidualTransport": "symfuse.symmetry.transport",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ALL_KINDS",
    "SYMMETRY_KINDS",
    "FFNPermutation",
    "FFNTransport",
    "HeadPermutation",
    "HeadTransport",
    "ModuleTransform",
    "QKLinear",
    "QKRotation",
    "QKScaling",
    "SymmetryKind",
    "Transform",
    "VOLinear",
    "VORotation",
    "VOScaling",
    "check_kinds",
    "kind_names",
    "load_transforms",
    "random_module_transform",
    "random_orthogonal",
    "register_kind",
    "register_transform",
    "rope_rotation",
    "save_transforms",
    "unregister_kind",
]
