"""Statistics belong to their model: fingerprints written with the statistics and checked before a merge.

``symfuse stats`` records ``model_fingerprint`` (the config and tensors of the model it ran on) in every file;
statistics that followed a matching (:func:`symfuse.stats.transform_stats`) also record
``transforms_fingerprint`` (the ``transforms.safetensors`` they followed) and ``source_model_fingerprint``.
:func:`check_stats_belong` refuses, naming both paths, statistics paired with another model; a folder whose
files carry different fingerprints (a half-overwritten folder) is refused by :func:`check_stats_consistent`.

A model's fingerprint hashes what it computes with, not how it is stored: its config (less what ``save_pretrained``
writes about the writer) and each tensor's name, dtype, shape and bytes, in name order. A re-sharded or re-saved
copy of a model keeps its fingerprint. Statistics written before (``files_fingerprint``: the bytes of
``config.json`` and every ``*.safetensors`` file, 16 hex digits without a scheme prefix) are checked as they were.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from symfuse.errors import StatsMismatchError
from symfuse.io.folder import open_weight_files
from symfuse.stats.io import StatsFile, file_fingerprint

log = logging.getLogger(__name__)

TRANSFORMS_FILE = "transforms.safetensors"  # written by matching next to the matched weights
# residual-orthogonal matching's one map of the whole stream, beside its per-module parts in TRANSFORMS_FILE
RESIDUAL_MAP_FILE = "residual_orthogonal.safetensors"
_KEYS = ("model_fingerprint", "transforms_fingerprint")
_SCHEME = "w1:"  # model_fingerprint's prefix; a recorded value without one is a files_fingerprint
# what save_pretrained writes about the writer, not the model; the dtype key is spelt two ways across versions
_WRITER_KEYS = ("transformers_version", "_name_or_path")
_READ_BYTES = 1 << 24


def files_fingerprint(folder: str | os.PathLike) -> str:
    """Hash of a checkpoint folder's ``config.json`` and ``*.safetensors`` files' bytes (the pipeline's cache keys)."""
    folder = Path(folder)
    files = [folder / "config.json", *sorted(folder.glob("*.safetensors"))]
    return file_fingerprint(*[f for f in files if f.exists()])


def model_fingerprint(folder: str | os.PathLike) -> str:
    """Hash of a checkpoint's config and tensors, the same for any sharding or re-save of them.

    Reads every weight byte once, as :func:`files_fingerprint` does.

    Raises:
        CheckpointError: the folder's weights are missing or malformed.
    """
    folder = Path(folder)
    mapping, files = open_weight_files(folder)
    h = hashlib.sha256(_config_bytes(folder / "config.json"))
    with contextlib.ExitStack() as stack:
        handles = {path: stack.enter_context(open(path, "rb")) for path in set(mapping.values())}  # one open a file
        for name in sorted(mapping):
            info, fh = files[mapping[name]].info(name), handles[mapping[name]]
            h.update(json.dumps([name, str(info.dtype), list(info.shape)]).encode())
            fh.seek(info.begin)
            left = info.nbytes
            while left and (chunk := fh.read(min(left, _READ_BYTES))):
                h.update(chunk)
                left -= len(chunk)
    return _SCHEME + h.hexdigest()[:16]


def _config_bytes(config: Path) -> bytes:
    """``config.json`` as sorted JSON without the writer's keys (its raw bytes if it is not a JSON object)."""
    try:
        raw = config.read_bytes()
    except FileNotFoundError:
        return b""
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return raw
    if not isinstance(data, dict):
        return raw
    data = {k: v for k, v in data.items() if k not in _WRITER_KEYS}
    if "torch_dtype" in data:  # transformers 5 writes it as "dtype"
        data.setdefault("dtype", data.pop("torch_dtype"))
    return json.dumps(data, sort_keys=True).encode()


def same_model(model: str | os.PathLike, recorded: str, fingerprint: str) -> bool:
    """Whether ``recorded`` is the fingerprint of ``model``, whose :func:`model_fingerprint` is ``fingerprint``."""
    return recorded == recorded_fingerprint(model, recorded, {(Path(model).resolve(), False): fingerprint})


def recorded_fingerprint(model: str | os.PathLike, recorded: str, cache: dict[Any, str] | None = None) -> str:
    """``model``'s fingerprint in the scheme ``recorded`` was written in (to compare them).

    Args:
        model: A checkpoint folder.
        recorded: A fingerprint read from a statistics file.
        cache: Fingerprints already computed, by folder and scheme (hashing reads every weight byte).
    """
    legacy = not recorded.startswith(_SCHEME)
    key = (Path(model).resolve(), legacy)
    cache = cache if cache is not None else {}
    if key not in cache:
        cache[key] = files_fingerprint(model) if legacy else model_fingerprint(model)
    return cache[key]


def check_stats_consistent(files: Sequence[StatsFile], where: str | os.PathLike) -> None:
    """Refuse statistics files of one folder (or pairing) that name different models or transforms.

    Raises:
        StatsMismatchError: naming the two files.
    """
    for key in _KEYS:
        seen = [(sf, str(sf.meta[key])) for sf in files if sf.meta.get(key)]
        for sf, value in seen[1:]:
            if value != seen[0][1] and value.startswith(_SCHEME) == seen[0][1].startswith(_SCHEME):
                raise StatsMismatchError(
                    f"{where}: {seen[0][0].path.name} and {sf.path.name} carry different {key}s "
                    f"({seen[0][1]} vs {value}): the folder mixes statistics of two models (half overwritten?) — "
                    "recollect every kind with one `symfuse stats` run"
                )


def check_stats_belong(
    model: str | os.PathLike, files: Sequence[StatsFile], where: str | os.PathLike, cache: dict[Any, str] | None = None
) -> None:
    """Refuse statistics that were not collected on (or transformed onto) ``model``.

    Files without a recorded fingerprint (written by other tools) are accepted with a warning.

    Args:
        model: The checkpoint folder the statistics are paired with.
        files: Its statistics files (one per kind).
        where: The statistics folder or file given by the user (for the message).
        cache: Fingerprints already computed (see :func:`recorded_fingerprint`).

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
        got = recorded_fingerprint(model, str(want), cache)
        if got != str(want):
            raise StatsMismatchError(
                f"{where}: statistics were collected on another model (fingerprint {want}), not on {model} "
                f"(fingerprint {got}) — pass one stats folder per model in --models order, or recollect "
                f"them with `symfuse stats {model}`"
            )
