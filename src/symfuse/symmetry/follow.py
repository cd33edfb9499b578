"""How a diagonal Fisher follows a transform part (the ``fisher`` functions of :mod:`symfuse.symmetry.registry`).

A diagonal Fisher follows a part exactly only when the part maps each parameter entry to ONE entry times a
constant: permutations move entries (``F' = F[perm]``), scalings ``w' = s w`` give ``F' = F / s^2``. A rotation
mixes entries and would need the off-diagonal Fisher: its kind declares no ``fisher`` (recollect).
"""

from __future__ import annotations

from symfuse.symmetry.transforms import QKScaling, Transform, VOScaling


def fisher_of_permutation(part: Transform) -> Transform:
    """A permutation moves Fisher entries with the weights: the same part."""
    return part


def fisher_of_scaling(part: Transform) -> Transform:
    """``w' = s w`` gives ``F' = F / s^2``: the same kind of scaling by ``s^-2`` (the k / o side gets ``s^2``)."""
    if not isinstance(part, QKScaling | VOScaling):
        raise TypeError(f"fisher_of_scaling: {type(part).__name__} is not a QK / VO scaling")
    return type(part)(part.scale**-2)
