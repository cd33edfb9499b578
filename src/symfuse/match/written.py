"""Writing an aligned model held in memory, and checking what was WRITTEN (reloaded from disk), not the copy in memory.

transformers may name a family's modules differently in memory and on disk (5.x renames ViT's): a writer that
replaced the stored tensors it found by their in-memory names once left every ViT layer untransformed while the
in-memory check said exact. Saving through ``save_pretrained`` lets transformers write its own names, and the
check reloads the folder.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path

import torch

from symfuse.checkpoint import SIDE_FILES, CheckpointReader
from symfuse.match.output_check import StreamedReference, measure_outputs, within_tolerance
from symfuse.match.report import check_fields


def stored_dtype(folder: str | Path) -> torch.dtype:
    """The dtype of a checkpoint's first floating tensor."""
    with CheckpointReader(folder) as r:
        return next((r.dtype(n) for n in r.names() if r.dtype(n).is_floating_point), torch.float32)


def write_model(model: torch.nn.Module, source: str | Path, dest: Path, extra: Mapping[str, bytes] = ()) -> None:
    """``model`` (a copy of SOURCE's class) into ``dest`` in SOURCE's stored dtype, with SOURCE's side files."""
    dtype = stored_dtype(source)
    model.to(dtype).save_pretrained(str(dest))
    for side in SIDE_FILES:
        if (Path(source) / side).exists():
            shutil.copy2(Path(source) / side, dest / side)
    for name, data in dict(extra).items():
        (dest / name).write_bytes(data)


def check_written(
    dest: Path,
    source: str | Path,
    exact: bool,
    mode: str = "full",
    dtype: torch.dtype | None = None,
    reference: StreamedReference | None = None,
) -> dict:
    """The written model's outputs against SOURCE's (``dest`` read back from disk): the report's check keys.

    Args:
        dest: The folder written (not yet published).
        source: The source checkpoint's folder.
        exact: Whether every transform is exact (a soft map's difference is measured, never refused: its report
            says ``exact: false`` and whether it is ``within_tolerance`` all the same).
        mode: ``full`` (both models loaded), ``stream`` (layer by layer) or ``none`` (nothing reloaded).
        dtype: The stored dtype the tolerance is taken from (default: SOURCE's first floating tensor's).
        reference: SOURCE's streamed outputs, already under way (``stream`` only).

    Returns:
        :func:`symfuse.match.report.check_fields`.

    Raises:
        VerificationError: an exact alignment whose written model does not compute SOURCE's function.
    """
    dtype = dtype if dtype is not None else stored_dtype(source)
    if mode == "none":
        return check_fields(exact, mode, None, None, dtype)
    diff, scale = measure_outputs(dest, Path(source), mode, reference)
    within = within_tolerance(dest, Path(source), diff, scale, dtype, exact)  # an exact one outside it: refused
    return check_fields(exact and within, mode, diff, within, dtype)
