"""Exact symmetry transforms (value objects acting on module weights and on statistics)."""

from symfuse.symmetry.random import ALL_KINDS, random_module_transform, random_orthogonal, rope_rotation
from symfuse.symmetry.transforms import (
    FFNPermutation,
    HeadPermutation,
    ModuleTransform,
    QKRotation,
    QKScaling,
    Transform,
    VORotation,
    VOScaling,
    load_transforms,
    register_transform,
    save_transforms,
)
from symfuse.symmetry.transport import FFNTransport, HeadTransport, ResidualTransport  # soft OT maps (registered)

__all__ = [
    "ALL_KINDS",
    "FFNPermutation",
    "FFNTransport",
    "HeadPermutation",
    "HeadTransport",
    "ModuleTransform",
    "QKRotation",
    "QKScaling",
    "ResidualTransport",
    "Transform",
    "VORotation",
    "VOScaling",
    "load_transforms",
    "random_module_transform",
    "random_orthogonal",
    "register_transform",
    "rope_rotation",
    "save_transforms",
]
