"""A cheap look at a dataset before any heavy work: its source resolved, its split files, first records and labels.

:func:`probe_dataset` resolves a dataset argument as :func:`~symfuse.data.load_task_dataset` does (an explicit path,
then a bare name in ``$SYMFUSE_DATASETS``, ``../shared/datasets`` and the bundled demo data; see
:mod:`symfuse.data.locate`), then reads ``meta.json`` and only the first :data:`PROBE_RECORDS` records of each split
file, checked like the loader checks every record. Nothing is converted to Arrow and no file is read to its end, so
a run checks all the datasets it names in a fraction of a second each. Hub datasets (``owner/name``, ``hf:<id>``)
are not looked at: they are read when the run loads them.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from symfuse.data.dataset import LM_ONLY_EVALUATE, TASKS, _infer_task, _resolve_local, check_records, check_spelled_once
from symfuse.data.files import DatasetError, head_records
from symfuse.data.locate import not_found_message

PROBE_RECORDS = 16


@dataclass(frozen=True)
class DatasetProbe:
    """What the first records and ``meta.json`` of a dataset say.

    Attributes:
        source: The dataset argument as given.
        where: The folder (or file) it resolved to; the hub id for a hub dataset.
        task: ``classification`` | ``pair_classification`` | ``regression`` | ``ner``; None: a hub dataset, not read.
        labels: Class names (tags for NER): declared in ``meta.json``, else those of the first records.
        complete: Whether ``labels`` is the whole label set (declared in ``meta.json``).
        splits: The splits that have a file.
        multi_label: Whether a record's label is a list of class names.
    """

    source: str
    where: str
    task: str | None = None
    labels: tuple[str, ...] = ()
    complete: bool = False
    splits: tuple[str, ...] = ()
    multi_label: bool = False

    @property
    def read(self) -> bool:
        """Whether the files were read (False for a hub dataset)."""
        return self.task is not None


def offline_hub_problem(source: str) -> str | None:
    """Why the hub dataset ``source`` cannot be read here, or None.

    Only where hub access is off (``HF_DATASETS_OFFLINE`` / ``HF_HUB_OFFLINE``; ``python -m flows`` turns it off):
    then the datasets cache must hold it. Online, nothing is asked of the hub here.
    """
    from datasets import config, load_dataset_builder

    if not config.HF_HUB_OFFLINE:
        return None
    try:
        load_dataset_builder(source.removeprefix("hf:"))
    except Exception:  # not cached (datasets: "Couldn't reach ... (OfflineModeIsEnabled)")
        return (
            f"{source}: a hub dataset, but hub access is off here (HF_DATASETS_OFFLINE / HF_HUB_OFFLINE) and the "
            "datasets cache does not hold it — give a local folder or file (a name under ../shared/datasets or "
            "$SYMFUSE_DATASETS), or set HF_DATASETS_OFFLINE=0 where the hub is reachable"
        )
    return None


def split_names(source: str) -> tuple[str, ...] | None:
    """The splits of ``source`` that have a file, found as :func:`probe_dataset` finds them but reading no record.

    Returns:
        The split names; None for a hub dataset (``owner/name``, ``hf:<id>``), which is not looked at.

    Raises:
        DatasetError: a bare name that is found nowhere.
    """
    probe = _resolve(str(source))
    return None if probe is None else tuple(probe[1])


def _resolve(source: str) -> tuple[str, dict[str, Path], dict[str, Any] | None] | None:
    local = None if source.startswith("hf:") else _resolve_local(source)
    if local is None and "/" not in source and not source.startswith("hf:"):
        raise DatasetError(not_found_message(source))
    return local


_CONTENT: dict[tuple, str] = {}  # (split, file, size, mtime) of every split file -> its fingerprint


def content_fingerprint(source: str) -> str | None:
    """SHA-256 (16 hex digits) of a local dataset's split files and ``meta.json``; None for a hub dataset.

    What a stored result computed from the data is keyed by, with the name: one name or path holding other records
    is another dataset. The files are hashed once per process while their size and modification time stay.

    Raises:
        DatasetError: a bare name that is found nowhere.
    """
    local = _resolve(str(source))
    if local is None:
        return None
    _, files, meta = local
    ident = tuple((s, str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for s, f in sorted(files.items()))
    if (found := _CONTENT.get(ident)) is None:
        h = hashlib.sha256(json.dumps(meta, sort_keys=True, default=str).encode())
        for split, file in sorted(files.items()):
            h.update(split.encode())
            with open(file, "rb") as fh:
                while block := fh.read(1 << 24):
                    h.update(block)
        found = _CONTENT[ident] = h.hexdigest()[:16]
    return found


def probe_dataset(source: str, records: int = PROBE_RECORDS) -> DatasetProbe:
    """Resolve ``source`` and read its ``meta.json`` and the first ``records`` records of each split file.

    Args:
        source: A dataset argument (see :func:`symfuse.data.load_task_dataset`).
        records: Records read per split file.

    Returns:
        The :class:`DatasetProbe`.

    Raises:
        DatasetError: the source is found nowhere, a file is empty, not UTF-8, or a record read is malformed
            (file and line named), or ``meta.json`` is invalid.
    """
    source = str(source)
    if (local := _resolve(source)) is None:
        return DatasetProbe(source, source.removeprefix("hf:"))
    _name, files, meta = local
    heads = {file: head_records(file, records) for file in dict.fromkeys(files.values())}
    for file, recs in heads.items():
        if not recs:
            raise DatasetError(f"{file}: no records — add records to it, or remove the file")
    first = next(iter(files.values()))
    if meta is None:
        task, multi = _infer_task(heads[first][0][1])
        declared = None
    else:
        task, multi = meta.get("task"), bool(meta.get("multi_label", False))
        declared = meta.get("tags") if task == "ner" else meta.get("labels")
    if task == "language_modeling":
        raise DatasetError(LM_ONLY_EVALUATE.format(source=first.parent))
    if task not in TASKS:
        raise DatasetError(f"{first.parent / 'meta.json'}: unknown task {task!r} — give one of {', '.join(TASKS)} (or "
                           "language_modeling, which evaluate, barrier and inspect read)")  # fmt: skip
    known = set(declared) if declared else None
    seen: set[str] = set()
    for file, recs in heads.items():
        seen |= check_records(file, recs, task, multi, known)
    labels = tuple(declared) if declared else () if task == "regression" else tuple(sorted(seen))
    where = str(first.parent if len(set(files.values())) > 1 or meta is not None else Path(first))
    if not declared:
        check_spelled_once(source, list(labels))
    complete = bool(declared) or task == "regression"
    return DatasetProbe(source, where, task, labels, complete, tuple(files), multi)


def twin_datasets(
    datasets: Iterable[Any], probes: Mapping[str, DatasetProbe], sets: Mapping[str, DatasetProbe], held_out: list[str]
) -> list[str]:
    """Problem lines for one dataset read under two names: twin fine-tunes, or a training set scored as held out.

    Two spellings of one folder (a trailing slash, a symlink, a relative path) under two names would fine-tune twins
    of one model (or bring one checkpoint twice) and merge them as two; an out-of-domain set that a model trained on
    would score it "out of domain" on its own data.

    Args:
        datasets: The run's datasets (``name``, ``max_train_examples``, ``checkpoint``: what makes the models differ).
        probes: Their probes by name (a dataset without one is left out).
        sets: Probes of the evaluation sets by name.
        held_out: The out-of-domain sets' names (none names a training set: RunConfig refuses that).
    """
    seen: dict[tuple[str, object], str] = {}
    trained: dict[str, str] = {}
    problems = []
    for d in datasets:
        name, probe, settings = d.name, probes.get(d.name), (d.max_train_examples, d.checkpoint)
        if probe is None:
            continue
        where = _location(probe)
        trained.setdefault(where, name)
        first = seen.setdefault((where, settings), name)
        if first != name:
            problems.append(f"training dataset {name}: reads {probe.where}, as {first} does, with the same settings — "
                            f"its fine-tune would be {first}'s twin; list the dataset once")  # fmt: skip
    for name in held_out:
        probe = sets.get(name)
        if probe is not None and (first := trained.get(_location(probe))) is not None:
            problems.append(f"evaluation set {name}: reads {probe.where}, which training dataset {first} trains on — "
                            f"{first}'s model would be scored out of domain on its own data; drop {name}")  # fmt: skip
        elif probe is not None and (copied := _copied_from(probe.source, trained)) is not None:
            problems.append(f"evaluation set {name}: {copied} — its models would be scored out of domain on data "
                            f"they trained on; drop {name}, or remove those records from it")  # fmt: skip
    return problems


_LINES: dict[tuple, frozenset[int]] = {}  # (file, size, mtime) -> hashes of its record lines


def _records_of(file: Path) -> frozenset[int]:
    """Hashes of a data file's non-blank lines (its records, as written), read once per process while unchanged."""
    st = file.stat()
    key = (str(file.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _LINES:
        with open(file, "rb") as fh:
            _LINES[key] = frozenset(hash(line.strip()) for line in fh if line.strip())
    return _LINES[key]


def _copied_from(source: str, trained: Mapping[str, str]) -> str | None:
    """How an out-of-domain set copies a training set's records (half or more of one of its files), else None."""
    mine = _resolve(source)
    if mine is None:
        return None
    for where, name in trained.items():
        theirs = _resolve(where) if os.path.exists(where) else None
        if theirs is None:
            continue
        pool = frozenset().union(*(_records_of(f) for f in theirs[1].values()))
        for split, file in mine[1].items():
            records = _records_of(file)
            shared = len(records & pool)
            if records and shared * 2 >= len(records):
                return f"{shared} of the {len(records)} records of its {split} file {file} are {name}'s"
    return None


def _location(probe: DatasetProbe) -> str:
    """Where a probed dataset lives, however it was spelled (a hub id as it is)."""
    return os.path.realpath(probe.where) if os.path.exists(probe.where) else probe.where
