"""What every alignment driver checks of its inputs, and the names of the files a matched folder holds."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from symfuse.arch import ModuleRef
from symfuse.checkpoint import CheckpointReader
from symfuse.errors import CheckpointError
from symfuse.match.reading import PreadSource

TRANSFORMS_FILE = "transforms.safetensors"
RESIDUAL_FILE = "residual_permutation.safetensors"
REPORT_FILE = "symfuse_report.json"


def read_checked(source: PreadSource, ref: ModuleRef) -> dict[str, torch.Tensor]:
    """One module's canonical weights in private memory (freed with the tensors), checked finite."""
    w = source.read_module(ref)
    check_finite(w, f"{source.reader.path}: {ref.key}")
    return w


def check_finite(weights: Mapping[str, torch.Tensor], where: str) -> None:
    """Raise :class:`CheckpointError` naming ``where`` and the role if a tensor holds NaN or inf.

    One reduction per tensor: a sum is finite only if every element is (NaN and inf propagate); only a
    non-finite sum (NaN / inf, or a finite overflow) is checked element by element.
    """
    for role, t in weights.items():
        if t.is_floating_point() and not torch.isfinite(t.sum()) and not torch.isfinite(t).all():
            raise CheckpointError(f"{where} {role} holds NaN or inf values; fix or re-export the checkpoint")


def check_compatible(src: CheckpointReader, anc: CheckpointReader) -> None:
    """Raise :class:`CheckpointError` (naming both folders) unless the two models share family and shapes."""
    if src.spec.family != anc.spec.family:
        raise CheckpointError(
            f"{src.path} is a {src.spec.family} model but {anc.path} is a {anc.spec.family} model; "
            "matching needs two models of one family"
        )
    if src.geometry != anc.geometry:
        from symfuse.symmetry.widen import GROUPS, describe, exact_group, widths_differ_only

        hint = ""
        if widths_differ_only(src.geometry, anc.geometry) and exact_group(src.spec) in GROUPS:
            hint = (" — models of different widths align only with --symmetries residual-orthogonal (the narrower "
                    "one, given first, is widened exactly)")  # fmt: skip
        elif widths_differ_only(src.geometry, anc.geometry):  # post-LN: its norms cannot be folded to widen
            hint = f" — {src.spec.family} is post-LN, and models of different widths align only in pre-norm families"
        raise CheckpointError(
            f"{src.path} and {anc.path} have different shapes: {describe(src.geometry)} vs {describe(anc.geometry)}"
            + hint
        )


def check_shapes(ref: ModuleRef, s: Mapping[str, torch.Tensor], a: Mapping[str, torch.Tensor], where: str) -> None:
    """Raise :class:`CheckpointError` (naming ``where`` and the role) unless both modules' roles have one shape."""
    for role in s.keys() | a.keys():
        if role not in s or role not in a or s[role].shape != a[role].shape:
            shape_s = tuple(s[role].shape) if role in s else None
            shape_a = tuple(a[role].shape) if role in a else None
            raise CheckpointError(f"{where}: module {ref.key} role {role!r}: shapes {shape_s} vs {shape_a}")


def strip_prefix(name: str, prefix: str) -> str:
    """``name`` without the base-model ``prefix`` (unchanged when it lacks it)."""
    return name[len(prefix) :] if prefix and name.startswith(prefix) else name
