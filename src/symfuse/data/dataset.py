"""Task datasets: shared JSON Lines folders, local CSV/JSON files and hub ids, through one ``datasets`` code path.

Sources accepted by :func:`load_task_dataset`, tried in this order:

1. an explicit path: a folder holding ``{train,validation,test}.{jsonl,json,csv}`` (+ an optional ``meta.json``), one
   local ``.jsonl``/``.json``/``.csv`` file (becomes every split), or ``"train=a.csv,test=b.csv"``;
2. a bare name (``"meld"``) found as a folder in ``$SYMFUSE_DATASETS``;
3. ... in the shared datasets folder ``../shared/datasets`` (next to or inside the repository or the working
   directory; ``$SYMFUSE_SHARED_DATASETS`` replaces that location, an empty value skips it);
4. ... in the demo data bundled with the package (``symfuse/data/demo/``: seeded subsets of crowdflower, goemotions,
   meld and goemotions_ekman, with their sources and licences in ``SOURCES.md``);
5. a hub dataset id ``owner/name`` or ``hf:<id>`` (needs network); a bare name found nowhere above fails at once.

Every local file is checked line by line before it is read (JSON by ``datasets.load_dataset("json", ...)``, CSV
from the checked records as strings): a bad record fails with one :class:`DatasetError` naming file and line. Record
formats (see ``shared/datasets/README.md``): ``{"text", "label"}`` (single- or multi-label, a list for
multi-label), ``{"text", "text_pair", "label"}`` (pairs; float label = regression), ``{"tokens", "tags"}`` (NER, BIO).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from symfuse.data.files import (
    NER_SCHEME,
    DatasetError,
    listed_twice,
    not_a_ner_tag,
    read_meta,
    read_records,
    read_splits,
)
from symfuse.data.locate import (  # shared_datasets_dir: re-exported, it used to live here
    dataset_search_path,
    find_named_dataset,
    not_found_message,
    shared_datasets_dir,  # noqa: F401
)

log = logging.getLogger(__name__)

SPLITS = ("train", "validation", "test")
TASKS = ("classification", "pair_classification", "regression", "ner")
LM_ONLY_EVALUATE = (
    "{source}: a language-modelling dataset (text, no labels) — `symfuse evaluate`, `barrier` and `inspect --data` "
    "read it, scoring causal LMs by next-token loss, and `match --data` its texts; fine-tuning, statistics, merges "
    "and `match --refine` need a classification or NER dataset"
)
_EXTS = (".jsonl", ".json", ".csv")
_SPLIT_ALIASES = {"train": ("train",), "validation": ("validation", "val", "dev"), "test": ("test",)}


@dataclass
class TaskDataset:
    """A loaded task: its splits (``datasets.Dataset`` with the canonical record columns) and label space.

    Attributes:
        name: Short name (folder or file stem, or the hub id).
        task: ``classification`` | ``pair_classification`` | ``regression`` | ``ner``.
        multi_label: Whether ``label`` is a list of class names (one binary output per class).
        labels: Class names (classification), BIO tags (NER), ``[]`` (regression); the order fixes label ids.
        splits: Split name -> ``datasets.Dataset``.
        meta: ``meta.json`` content (or the inferred equivalent).
        fingerprint: Hash of the data files' bytes plus the subsampling settings.
        source: The string the dataset was loaded from.
        files: Split name -> local file (empty for hub datasets).
    """

    name: str
    task: str
    multi_label: bool
    labels: list[str]
    splits: dict[str, Any]
    meta: dict[str, Any] = field(default_factory=dict)
    fingerprint: str = ""
    source: str = ""
    files: dict[str, Path] = field(default_factory=dict)

    @property
    def num_labels(self) -> int:
        """Model outputs: number of classes/tags, 1 for regression."""
        return 1 if self.task == "regression" else len(self.labels)

    @property
    def label2id(self) -> dict[str, int]:
        """Label name -> id."""
        return {name: i for i, name in enumerate(self.labels)}

    @property
    def id2label(self) -> dict[int, str]:
        """Label id -> name (``{0: "score"}`` for regression)."""
        return {0: "score"} if self.task == "regression" else dict(enumerate(self.labels))

    @property
    def is_token_task(self) -> bool:
        """Whether labels are per token (NER)."""
        return self.task == "ner"

    @property
    def is_pair(self) -> bool:
        """Whether records carry a ``text_pair``."""
        return self.task in ("pair_classification", "regression")

    @property
    def problem_type(self) -> str:
        """HF problem type: ``single_label_classification``, ``multi_label_classification``, ``regression``, or NER."""
        if self.task == "ner":
            return "token_classification"
        if self.task == "regression":
            return "regression"
        return "multi_label_classification" if self.multi_label else "single_label_classification"

    def split(self, name: str) -> Any:
        """One split, with a clear error naming the available ones.

        Raises:
            DatasetError: if the split is absent.
        """
        if name not in self.splits:
            raise DatasetError(f"{self.source}: no split {name!r} (available: {sorted(self.splits)}) — add "
                               f"{name}.jsonl there, or read one of those where the command takes --split")  # fmt: skip
        return self.splits[name]


# ----------------------------------------------------------------------------------------------- locating sources


def _split_files(folder: Path) -> dict[str, Path]:
    """Each split's file in ``folder``; two files for one split (``train.jsonl`` and ``train.csv``) are refused."""
    found: dict[str, Path] = {}
    for split, aliases in _SPLIT_ALIASES.items():
        files = [folder / f"{a}{ext}" for a in aliases for ext in _EXTS if (folder / f"{a}{ext}").is_file()]
        if len(files) > 1:
            names = " and ".join(f.name for f in files)
            raise DatasetError(f"{folder}: {names} are both the {split} split — keep one, or move the other away")
        if files:
            found[split] = files[0]
    return found


def _resolve_local(source: str) -> tuple[str, dict[str, Path], dict[str, Any] | None] | None:
    """``(name, split files, meta or None)`` for a local source, or None when it is not local."""
    if "=" in source and all("=" in part for part in source.split(",")):
        files = {}
        for part in source.split(","):
            split, _, file = part.partition("=")
            path = Path(file.strip())
            if not path.is_file():
                raise DatasetError(f"{path}: data file not found (split {split.strip()!r})")
            files[split.strip()] = path
        return Path(next(iter(files.values()))).stem, files, None
    path = Path(source)
    if not path.exists() and "/" not in source and "\\" not in source:
        path = find_named_dataset(source) or path
    if path.is_dir():
        files = _split_files(path)
        if not files:
            raise DatasetError(f"{path}: no train/validation/test .jsonl/.json/.csv files in this folder")
        meta_file = path / "meta.json"
        meta = read_meta(meta_file) if meta_file.exists() else None
        return path.name, files, meta
    if path.is_file():
        if path.suffix not in _EXTS:
            raise DatasetError(f"{path}: unsupported file type (use .jsonl, .json or .csv)")
        return path.stem, dict.fromkeys(SPLITS, path), None
    if source.startswith((".", "/", "~")) or path.suffix in _EXTS:
        raise DatasetError(
            f"{source}: no such dataset folder or file — check the path (a folder of train / validation / test files, "
            "or one .jsonl / .json / .csv file)"
        )
    return None


# ----------------------------------------------------------------------------------------------- record checking


def _infer_task(rec: dict[str, Any]) -> tuple[str, bool]:
    if "tokens" in rec or "tags" in rec:
        return "ner", False
    label = rec.get("label")
    if isinstance(label, list):
        return "classification", True
    if isinstance(label, float) or (isinstance(label, int) and not isinstance(label, bool) and "text_pair" in rec):
        return ("regression" if isinstance(label, float) else "pair_classification"), False
    return ("pair_classification" if "text_pair" in rec else "classification"), False


def _check_record(rec: dict[str, Any], task: str, multi_label: bool, labels: set[str] | None) -> str | None:
    """A description of what is wrong with one record, or None."""
    if task == "ner":
        tokens, tags = rec.get("tokens"), rec.get("tags")
        if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
            return "'tokens' must be a list of strings"
        if not isinstance(tags, list) or len(tags) != len(tokens):
            return f"'tags' must be a list with one tag per token ({len(tokens)} tokens)"
        if labels is not None:  # meta.json's tags were checked against the scheme when it was read
            bad = [t for t in tags if t not in labels]
            if bad:
                return f"unknown tag {bad[0]!r} (not in meta.json tags: add it there if it is one)"
        elif (tag := not_a_ner_tag(tags)) is not None:
            return f"tag {tag!r} {NER_SCHEME}"
        return None
    if not isinstance(rec.get("text"), str):
        return "missing or non-string 'text'"
    if task in ("pair_classification", "regression") and not isinstance(rec.get("text_pair"), str):
        return f"missing or non-string 'text_pair' (a {task} record holds two texts)"
    label = rec.get("label")
    if task == "regression":
        try:
            value = float(label)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return f"label {label!r} is not a number"
        if isinstance(label, bool) or not math.isfinite(value):
            return f"label {json.dumps(label)} is not a finite number"
        return None
    if multi_label:
        if not isinstance(label, list) or not all(isinstance(x, str) for x in label):
            return "multi-label 'label' must be a list of class names"
        names = label
    else:
        if isinstance(label, bool):  # str() gives 'True', the Arrow loader 'true': neither names the class reliably
            return (
                f'label {str(label).lower()} is a JSON boolean — write the class as a string ("{str(label).lower()}")'
            )
        if label is None or isinstance(label, (list, dict, float)):
            return f"label {label!r} must be one class name"
        names = [str(label)]
    if labels is not None:
        bad = [x for x in names if x not in labels]
        if bad:
            return f"unknown label {bad[0]!r} (meta.json lists {sorted(labels)}: add it there if it is a class)"
    return None


_CHECKED: dict[tuple[str, int, int, str], list[str]] = {}


def _check_file(file: Path, task: str, multi_label: bool, labels: list[str] | None) -> list[str]:
    """Check every record; return the label values seen (for label-space inference). Cached per file version."""
    stat = file.stat()
    key = (str(file.resolve()), stat.st_size, stat.st_mtime_ns, f"{task}{multi_label}{labels}")
    if key in _CHECKED:
        return _CHECKED[key]
    known = set(labels) if labels else None
    records = read_records(file)
    if not records:
        raise DatasetError(f"{file}: no records — add records to it, or remove the file")
    seen = check_records(file, records, task, multi_label, known)
    if empty := _all_empty(records, task, multi_label):
        raise DatasetError(f"{file}: every record's {empty} is empty — a model learns nothing from it; check how the "
                           "file was written")  # fmt: skip
    _CHECKED[key] = sorted(seen)
    return _CHECKED[key]


def _all_empty(records: list[tuple[int, dict[str, Any]]], task: str, multi_label: bool) -> str | None:
    """What every record of a file has empty (``text``, ``tokens``, multi-label ``label``), or None."""
    if task == "ner":
        return None if any(r["tokens"] for _, r in records) else "tokens"
    if not any(r["text"].strip() or str(r.get("text_pair") or "").strip() for _, r in records):
        return "text"
    return "label" if multi_label and not any(r["label"] for _, r in records) else None


def check_records(
    file: Path, records: list[tuple[int, dict[str, Any]]], task: str, multi_label: bool, known: set[str] | None
) -> set[str]:
    """Check ``(line number, record)`` pairs of ``file``; return the label values seen (tags for NER).

    Raises:
        DatasetError: the first bad record, naming the file and line.
    """
    seen: set[str] = set()
    first: tuple[int, Any] | None = None  # a single label's line and value: one file's labels are of one JSON kind
    for lineno, rec in records:
        problem = _check_record(rec, task, multi_label, known)
        if not problem and task in ("classification", "pair_classification") and not multi_label:
            first = first or (lineno, rec["label"])
            if isinstance(rec["label"], str) != isinstance(first[1], str):  # the loader read '"x"' for x
                problem = f"label {json.dumps(rec['label'])} and line {first[0]}'s {json.dumps(first[1])} are of two "
                problem += "JSON kinds (a number, a string) — write every label as a string"
        if problem:
            raise DatasetError(f"{file}:{lineno}: bad {task} record: {problem} — fix or remove that line")
        if task == "ner":
            seen.update(rec["tags"])
        elif task != "regression":
            seen.update(rec["label"] if multi_label else [str(rec["label"])])
    return seen


# ----------------------------------------------------------------------------------------------- loading


def _fingerprint(files: dict[str, Path], extra: str) -> str:
    h = hashlib.sha256(extra.encode())
    for split in sorted(files):
        h.update(split.encode())
        h.update(files[split].read_bytes())
    return h.hexdigest()[:16]


def subsample_indices(n: int, k: int | None, seed: int) -> list[int]:
    """Seeded subsample of ``k`` of ``range(n)`` indices, kept in source order (all when ``k`` is None or >= n)."""
    if k is None or k >= n:
        return list(range(n))
    return sorted(random.Random(seed).sample(range(n), k))


_LOCAL_CACHE: dict[tuple, TaskDataset] = {}
_ANNOUNCED: set[tuple[str, str]] = set()  # (source, fingerprint) of the datasets logged at INFO
_LOCAL_LOCK = threading.Lock()
_LOCAL_CACHE_SIZE = 16


def _size_mtime(file: Path) -> tuple[int, int]:
    st = file.stat()
    return st.st_size, st.st_mtime_ns


def _load_local_cached(name: str, files: dict[str, Path], meta: dict[str, Any] | None, source: str) -> TaskDataset:
    """:func:`_load_local`, parsed and checked once per process while the files are unchanged.

    Evaluation loads the same few sets dozens of times (every model x every set); validating every line and
    building the Arrow tables took ~2 s each time. The key holds each file's resolved path, size and mtime (a
    rewritten file is read again) and the meta; a hit returns a new :class:`TaskDataset` sharing the immutable
    split tables (``datasets.Dataset.select`` returns new tables, so callers cannot change the cached one).
    """
    key = (
        name,
        json.dumps(meta, sort_keys=True, default=str),
        tuple(sorted((s, str(f.resolve()), *_size_mtime(f)) for s, f in files.items())),
    )
    with _LOCAL_LOCK:  # one parse per key, also when several threads ask at once
        ds = _LOCAL_CACHE.get(key)
        if ds is None:
            ds = _load_local(name, files, meta, source)
            if len(_LOCAL_CACHE) >= _LOCAL_CACHE_SIZE:
                _LOCAL_CACHE.pop(next(iter(_LOCAL_CACHE)))
            _LOCAL_CACHE[key] = ds
    return replace(
        ds, splits=dict(ds.splits), meta=dict(ds.meta), labels=list(ds.labels), files=dict(ds.files), source=source
    )


def check_spelled_once(source: object, labels: list[str]) -> None:
    """Refuse classes inferred from the records that differ only in case (every name match is case-insensitive)."""
    if twice := listed_twice(labels):
        raise DatasetError(f"{source}: the records spell one class two ways ({twice}; classes are matched "
                           "case-insensitively) — spell it one way, or list the classes in meta.json")  # fmt: skip


def _load_local(name: str, files: dict[str, Path], meta: dict[str, Any] | None, source: str) -> TaskDataset:
    if meta is None:
        first = read_records(next(iter(files.values())))
        if not first:
            raise DatasetError(f"{next(iter(files.values()))}: no records — add records to it, or remove the file")
        task, multi = _infer_task(first[0][1])
        meta = {"task": task, "multi_label": multi, "inferred": True}
    task = meta.get("task")
    if task == "language_modeling":
        raise DatasetError(LM_ONLY_EVALUATE.format(source=source))
    if task not in TASKS:
        raise DatasetError(f"{source}/meta.json: unknown task {task!r} — give one of {', '.join(TASKS)} (or "
                           "language_modeling, which evaluate, barrier and inspect read)")  # fmt: skip
    multi = meta.get("multi_label", False)
    if not isinstance(multi, bool):  # bool("false") is True
        raise DatasetError(f"{source}/meta.json: multi_label is {multi!r}, not true or false — write it as a JSON "
                           "boolean")  # fmt: skip
    declared = meta.get("tags") if task == "ner" else meta.get("labels")
    seen: set[str] = set()
    for file in dict.fromkeys(files.values()):
        seen.update(_check_file(file, task, multi, declared))
    labels = list(declared) if declared else ([] if task == "regression" else sorted(seen))
    if not declared:
        check_spelled_once(source, labels)
    splits = read_splits(files, source)
    if task == "regression":
        from datasets import Value

        splits = {s: d.cast_column("label", Value("float32")) for s, d in splits.items()}
    elif task != "ner" and not multi:
        splits = {s: _stringify_label(d) for s, d in splits.items()}
    return TaskDataset(name, task, multi, labels, splits, meta, _fingerprint(files, ""), source, dict(files))


def _stringify_label(ds: Any) -> Any:
    from datasets import Value

    return ds if ds.features["label"] == Value("string") else ds.cast_column("label", Value("string"))


def _load_hub(source: str) -> TaskDataset:
    from datasets import ClassLabel, Sequence, load_dataset

    try:
        dd = load_dataset(source)
    except Exception as exc:
        raise DatasetError(
            f"{source}: not a local dataset name, folder or file, nor a reachable hub dataset "
            f"({type(exc).__name__}: {' '.join(str(exc).split())}); local folders searched: "
            f"{[str(f) for _, f in dataset_search_path()]}"
        ) from exc
    splits = {("validation" if s in ("val", "dev") else s): d for s, d in dd.items()}
    first = next(iter(splits.values()))
    feats = first.features
    rename = {"sentence": "text", "sentence1": "text", "sentence2": "text_pair", "ner_tags": "tags"}
    if "labels" in feats and "label" not in feats:
        rename["labels"] = "label"
    rename = {k: v for k, v in rename.items() if k in feats and v not in feats}
    splits = {s: d.rename_columns(rename) for s, d in splits.items()}
    feats = next(iter(splits.values())).features
    labels: list[str] = []
    if "tags" in feats:
        task, multi = "ner", False
        tag_feat = feats["tags"]
        inner = tag_feat.feature if isinstance(tag_feat, Sequence) else getattr(tag_feat, "feature", None)
        if isinstance(inner, ClassLabel):
            labels = list(inner.names)
            splits = {s: d.map(lambda r: {"tags": [labels[t] for t in r["tags"]]}) for s, d in splits.items()}
    else:
        lab = feats["label"]
        inner = getattr(lab, "feature", None)
        multi = inner is not None
        if isinstance(lab, ClassLabel) or isinstance(inner, ClassLabel):
            labels = list((inner or lab).names)
            if multi:
                splits = {s: d.map(lambda r: {"label": [labels[i] for i in r["label"]]}) for s, d in splits.items()}
            else:
                splits = {s: d.filter(lambda r: r["label"] >= 0) for s, d in splits.items()}  # unlabeled GLUE tests
                splits = {s: d.map(lambda r: {"label": labels[r["label"]]}) for s, d in splits.items()}
        is_float = getattr(lab, "dtype", "").startswith("float")
        task = "regression" if is_float else ("pair_classification" if "text_pair" in feats else "classification")
    if not labels and task != "regression":
        col = "tags" if task == "ner" else "label"
        vals: set[str] = set()
        for d in splits.values():
            for v in d[col]:
                vals.update(v if isinstance(v, list) else [str(v)])
        labels = sorted(vals)
    meta = {"task": task, "multi_label": multi, "labels": labels, "hub_id": source}
    fp = hashlib.sha256("".join(d._fingerprint for d in splits.values()).encode()).hexdigest()[:16]
    return TaskDataset(source.replace("/", "__"), task, multi, labels, splits, meta, fp, source, {})


def load_task_dataset(
    source: str,
    max_train_examples: int | None = None,
    seed: int = 13,
    max_eval_examples: int | None = None,
) -> TaskDataset:
    """Load a task dataset with its label space.

    Args:
        source: Dataset folder or local data file(s) (``"data.csv"``, ``"train=a.jsonl,test=b.jsonl"``), a bare
            name (``"meld"``: ``$SYMFUSE_DATASETS``, ``../shared/datasets``, then the bundled demo data), or a hub
            id (``owner/name`` or ``hf:<id>``).
        max_train_examples: Keep a seeded random subset of this many training examples (source order kept).
        seed: Seed of the subsampling.
        max_eval_examples: Same for the validation and test splits.

    Returns:
        The :class:`TaskDataset`.

    Raises:
        DatasetError: if the source cannot be found or a record is bad (names file and line).
    """
    source = str(source)
    if source.startswith("hf:"):
        ds = _load_hub(source[3:])
    elif (local := _resolve_local(source)) is not None:
        ds = _load_local_cached(*local, source=source)
    elif "/" not in source:  # a bare name that no local location holds: fail fast instead of asking the hub
        raise DatasetError(not_found_message(source))
    else:
        ds = _load_hub(source)
    for split, limit in (("train", max_train_examples), ("validation", max_eval_examples), ("test", max_eval_examples)):
        if split in ds.splits and limit is not None and limit < len(ds.splits[split]):
            ds.splits[split] = ds.splits[split].select(subsample_indices(len(ds.splits[split]), limit, seed))
    if max_train_examples is not None or max_eval_examples is not None:
        extra = f"{ds.fingerprint}:{max_train_examples}:{max_eval_examples}:{seed}"
        ds.fingerprint = hashlib.sha256(extra.encode()).hexdigest()[:16]
    announced = (ds.source, ds.fingerprint) in _ANNOUNCED  # a set read again (checks, evaluations): said once
    _ANNOUNCED.add((ds.source, ds.fingerprint))
    log.log(
        logging.DEBUG if announced else logging.INFO,
        "loaded %s (%s, %d labels): %s",
        ds.name,
        ds.problem_type,
        len(ds.labels),
        {s: len(d) for s, d in ds.splits.items()},
    )
    return ds
