"""Statistics belong to their model: fingerprints written with the statistics and checked before a merge.

``symfuse stats`` records ``model_fingerprint`` (config and weight files of the model it ran on) in every file;
statistics that followed a matching (:func:`symfuse.stats.transform_stats`) also record
``transforms_fingerprint`` (the ``transforms.safetensors`` they followed) and ``source_model_fingerprint``.
:func:`check_stats_belong` refuses, naming both paths, statistics paired with another model; a folder whose
files carry different fingerprints (a half-overwritten folder) is refused by :func:`check_stats_consistent`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

from symfuse.errors import StatsMismatchError
from symfuse.stats.io import StatsFile, file_fingerprint

log = logging.getLogger(__name__)

TRANSFORMS_FILE = "transforms.safetensors"  # written by matching next to the matched weights
# residual-orthogonal matching's one map of the whole stream, beside its per-module parts in TRANSFORMS_FILE
RESIDUAL_MAP_FILE = "residual_orthogonal.safetensors"
_KEYS = ("model_fingerprint", "transforms_fingerprint")


def model_fingerprint(folder: str | os.PathLike) -> str:
    """Hash of a checkpoint folder's config and weight files."""
    folder = Path(folder)
    files = [folder / "config.json", *sorted(folder.glob("*.safetensors"))]
    return file_fingerprint(*[f for f in files if f.exists()])


def check_stats_consistent(files: Sequence[StatsFile], where: str | os.PathLike) -> None:
    """Refuse statistics files of one folder (or pairing) that name different models or transforms.

    Raises:
        StatsMismatchError: naming the two files.
    """
    for key in _KEYS:
        seen = [(sf, str(sf.meta[key])) for sf in files if sf.meta.get(key)]
        for sf, value in seen[1:]:
            if value != seen[0][1]:
                raise StatsMismatchError(
                    f"{where}: {seen[0][0].path.name} and {sf.path.name} carry different {key}s "
                    f"({seen[0][1]} vs {value}): the folder mixes statistics of two models (half overwritten?) — "
                    "recollect every kind with one `symfuse stats` run"
                )


def check_stats_belong(
    model: str | os.PathLike, files: Sequence[StatsFile], where: str | os.PathLike, cache: dict[Path, str] | None = None
) -> None:
    """Refuse statistics that were not collected on (or transformed onto) ``model``.

    Files without a recorded fingerprint (written by other tools) are accepted with a warning.

    Args:
        model: The checkpoint folder the statistics are paired with.
        files: Its statistics files (one per kind).
        where: The statistics folder or file given by the user (for the message).
        cache: Fingerprints already computed, by folder (hashing reads every weight byte).

    Raises:
        StatsMismatchError: naming the statistics and the model.
    """
    check_stats_consistent(files, where)
    model = Path(model)
    cache = cache if cache is not None else {}
    for sf in files:
        want_t = sf.meta.get("transforms_fingerprint")
        if want_t:
            tfile = model / TRANSFORMS_FILE
            got_t = file_fingerprint(tfile) if tfile.is_file() else None
            if got_t != str(want_t):
                raise StatsMismatchError(
                    f"{where}: statistics follow the matching {want_t} but {model} "
                    f"{'was matched with another one (' + got_t + ')' if got_t else 'is not a matched model'} — "
                    "pair each transformed stats folder with the matched model it was transformed onto"
                )
        want = sf.meta.get("model_fingerprint")
        if not want:
            if not want_t:
                log.warning("%s: no model fingerprint recorded; cannot check that it belongs to %s", sf.path, model)
            continue
        key = model.resolve()
        if key not in cache:
            cache[key] = model_fingerprint(model)
        if cache[key] != str(want):
            raise StatsMismatchError(
                f"{where}: statistics were collected on another model (fingerprint {want}), not on {model} "
                f"(fingerprint {cache[key]}) — pass one stats folder per model in --models order, or recollect "
                f"them with `symfuse stats {model}`"
            )
