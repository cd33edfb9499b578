"""``symfuse merge --align KINDS``: every model aligned onto the first before any strategy merges them."""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from symfuse.errors import UsageError
from symfuse.match.align import OT_KINDS  # no torch
from symfuse.symmetry.registry import kind_names

ALIGN_KINDS = (*kind_names("activations"), *(k for k in OT_KINDS if "acts" in k))  # symfuse match's --symmetries


def check_align(kinds: Sequence[str], data: str | None, stats: Sequence[Any] | None) -> None:
    """Refuse, in one line each, what cannot be aligned before the merge (before any work)."""
    from symfuse.match.align import plan_alignment

    if stats:
        raise UsageError(
            "--align: statistics belong to the unaligned models — align with `symfuse match`, collect statistics on "
            "the aligned models, and merge those"
        )
    try:  # kinds that do not combine, kinds found from activations without data: named as this command's options
        plan_alignment(list(kinds), data, 0)
    except UsageError as exc:
        raise UsageError(str(exc).replace("--symmetries", "--align").replace("--data", "--align-data")) from exc


def merge_aligned(models: Sequence[str], kinds: Sequence[str], data: str | None, device: Any, merge: Any) -> Path:
    """Models 2..K aligned onto model 1 in a temporary folder, then ``merge(aligned_models, card)``.

    Each aligned model computes its own model's function (checked as written); the folder is removed afterwards.
    """
    from symfuse.match.align import align_checkpoints

    with tempfile.TemporaryDirectory(prefix="symfuse-align-") as tmp:
        aligned = [str(models[0])]
        for i, m in enumerate(models[1:], 1):
            dest = Path(tmp) / f"{i}" / Path(m).name  # the folder's own name: heads are named after it
            align_checkpoints(m, models[0], dest, list(kinds), data, device=device)
            aligned.append(str(dest))
        return merge(aligned, {"inputs": [str(m) for m in models], "symmetries": list(kinds)})
