"""Reading a local dataset's files: ``meta.json`` and the records of a JSON Lines / JSON array / CSV split file.

Every error is a :class:`DatasetError` naming the file and line (and column where there is one) and
what to do: a ``meta.json`` that is not JSON or not a mapping, bytes that are not UTF-8, a line that is not a JSON
object. :func:`read_records` reads a whole file (the loader checks every record); :func:`head_records` reads only the
first few (cheap checks before a run).
"""

from __future__ import annotations

import csv
import io
import json
import re
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from pathlib import Path
from typing import Any

from symfuse.errors import DataError

UTF8_FIX = "re-save it as UTF-8 text"


class DatasetError(DataError):
    """A dataset source is missing or holds a bad record (the message names the file and line)."""


def _not_utf8(file: Path, data: bytes, exc: UnicodeDecodeError, first_line: int = 1) -> DatasetError:
    """The error for bytes of ``file`` (starting at line ``first_line``) that are not UTF-8: line, column, byte."""
    line = first_line + data.count(b"\n", 0, exc.start)
    column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
    byte = data[exc.start : exc.start + 1].hex()
    return DatasetError(f"{file}:{line}: not UTF-8 (byte 0x{byte} at column {column}) — {UTF8_FIX}")


def decode(file: Path, data: bytes | None = None) -> str:
    """The text of ``file`` (or of its bytes ``data``), which must be UTF-8 (a BOM is dropped).

    Raises:
        DatasetError: naming the file, line and column of the first byte that is not UTF-8.
    """
    data = file.read_bytes() if data is None else data
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise _not_utf8(file, data, exc) from exc


def read_meta(file: Path) -> dict[str, Any]:
    """A dataset's ``meta.json``: a JSON mapping whose ``labels`` / ``tags`` (when given) list class names, each once.

    Raises:
        DatasetError: the file is not UTF-8, not JSON (line and column named) or not such a mapping, or a class is
            listed twice (case-insensitively: heads and data match classes by name so), or the list is empty (but
            for regression, which has no classes).
    """
    text = decode(file)
    try:
        meta = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DatasetError(
            f"{file}:{exc.lineno}:{exc.colno}: not valid JSON ({exc.msg}) — fix the file, or remove it to infer the "
            "task and labels from the records"
        ) from exc
    if not isinstance(meta, dict):
        got = type(meta).__name__
        raise DatasetError(f"{file}: expected a JSON object (task, labels, ...), got {got} — fix the file")
    for key in ("labels", "tags"):
        names = meta.get(key)
        if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
            raise DatasetError(f"{file}: {key} must be a list of class names, got {names!r} — fix the file")
        if names == [] and meta.get("task") != "regression":
            raise DatasetError(f"{file}: {key} is an empty list — list the classes, or remove the key to infer them "
                               "from the records")  # fmt: skip
        if key == "tags" and (bad := not_a_ner_tag(names or [])) is not None:
            raise DatasetError(f"{file}: tags lists {bad!r}, which {NER_SCHEME}")
        if twice := listed_twice(names or []):
            raise DatasetError(f"{file}: {key} lists {twice} twice (class names are matched case-insensitively) — "
                               "list each class once")  # fmt: skip
    return meta


# seqeval (entity F1) reads a tag as O, or a B / I / E / S prefix, a hyphen and an entity type; it warns about any
# other tag and counts it as outside every entity, so a dataset of such tags would score an entity F1 of 0
_NER_TAG = re.compile(r"O|[BIES]-.+")
NER_SCHEME = (
    "is not O or a B- / I- / E- / S- prefix and an entity type — entity F1 (seqeval) would count it as outside "
    "every entity; write BIO tags such as B-PER / I-PER / O"
)


def not_a_ner_tag(tags: Iterable[object]) -> object | None:
    """The first tag that is not a string of the BIO(ES) scheme seqeval scores (see :data:`NER_SCHEME`), or None."""
    return next((t for t in tags if not (isinstance(t, str) and _NER_TAG.fullmatch(t))), None)


def listed_twice(names: Iterable[str]) -> str | None:
    """The first name listed again (case-insensitively), as both spellings when they differ; else None."""
    seen: dict[str, str] = {}
    for n in names:
        if (first := seen.get(n.casefold())) is not None:
            return repr(n) if first == n else f"{first!r} and {n!r}"
        seen[n.casefold()] = n
    return None


def _keys_once(file: Path, lineno: int) -> Callable[[list[tuple[str, Any]]], dict[str, Any]]:
    """``json.loads``'s ``object_pairs_hook`` refusing a key given twice in one object (datasets cannot read it)."""

    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        record = dict(pairs)
        if len(record) < len(pairs):  # the common case costs one comparison
            keys = [k for k, _ in pairs]
            twice = next(k for i, k in enumerate(keys) if k in keys[:i])
            raise DatasetError(f"{file}:{lineno}: key {twice!r} appears twice in one record — keep one")
        return record

    return hook


def _json_line(file: Path, lineno: int, line: str) -> dict[str, Any]:
    try:
        rec = json.loads(line, object_pairs_hook=_keys_once(file, lineno))
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{file}:{lineno}: not valid JSON ({exc.msg}); fix or remove that line") from exc
    if _SURROGATE.search(line) and _lone_surrogate(rec):  # an escaped half of a UTF-16 pair: no text holds it
        raise DatasetError(f"{file}:{lineno}: a string holds a lone UTF-16 surrogate escape (such as \\ud800), "
                           "which is no character — fix or remove that line")  # fmt: skip
    if not isinstance(rec, dict):
        raise DatasetError(
            f"{file}:{lineno}: expected a JSON object, got {type(rec).__name__} — write one object per line, e.g. "
            '{"text": "...", "label": "joy"}'
        )
    return rec


_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")  # the escape of a UTF-16 surrogate (a pair's half, or alone)


def _lone_surrogate(value: Any) -> bool:
    """Whether a parsed JSON value holds a string that is not valid Unicode (a lone surrogate)."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _json_array(file: Path, text: str) -> list[tuple[int, dict[str, Any]]]:
    try:
        rows = json.loads(text, object_pairs_hook=_keys_once(file, 1))
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{file}:{exc.lineno}: not valid JSON ({exc.msg})") from exc
    if not isinstance(rows, list):
        raise DatasetError(f"{file}: expected a JSON array of records, got {type(rows).__name__}")
    for i, r in enumerate(rows):
        if not isinstance(r, dict):
            raise DatasetError(f"{file}: item {i + 1} of the array is a {type(r).__name__}, not a record — write "
                               'objects such as {"text": "...", "label": "joy"}')  # fmt: skip
    return [(i + 1, r) for i, r in enumerate(rows)]


def read_records(file: Path) -> list[tuple[int, dict[str, Any]]]:
    """``(line number, record)`` for each record of a JSON Lines / JSON array / CSV file.

    Raises:
        DatasetError: bytes that are not UTF-8, or a line that is not a JSON object (file and line named).
    """
    text = decode(file)
    if file.suffix == ".csv":
        return _csv_records(file, text)
    if file.suffix == ".json" and text.lstrip().startswith("["):
        return _json_array(file, text)
    # split on newlines only: str.splitlines also breaks at U+2028 / U+2029 / U+0085, which JSON strings may hold
    return [(n, _json_line(file, n, line)) for n, line in enumerate(text.split("\n"), start=1) if line.strip()]


def _csv_records(file: Path, text: str) -> list[tuple[int, dict[str, Any]]]:
    """The rows of a CSV file as string-valued records (line of each), its header naming each column once."""
    reader = csv.DictReader(io.StringIO(text, newline=""))
    names = reader.fieldnames or []
    if twice := next((n for i, n in enumerate(names) if n in names[:i]), None):
        raise DatasetError(f"{file}:1: the header names column {twice!r} twice — name each column once")
    rows = []
    for row in reader:
        if None in row:  # DictReader's key for the fields past the header's
            raise DatasetError(f"{file}:{reader.line_num}: {len(row[None])} more field(s) than the header names "
                               "columns — quote a field that holds a comma, or fix the line")  # fmt: skip
        rows.append((reader.line_num, row))
    return rows


def _lines(file: Path) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of each line of ``file``, decoded one at a time (a bad byte names its line)."""
    with file.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            try:
                yield lineno, raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                raise _not_utf8(file, raw, exc, lineno) from exc


def head_records(file: Path, n: int) -> list[tuple[int, dict[str, Any]]]:
    """The first ``n`` records of ``file`` (as :func:`read_records` gives them), reading no further than needed.

    A JSON array file is read whole (it has no line structure to stop at).

    Raises:
        DatasetError: as :func:`read_records`, for the part read.
    """
    if file.suffix == ".csv":
        return _csv_records(file, "".join(line for _, line in islice(_lines(file), n + 1)))[:n]
    lines = _lines(file)
    first = next(((k, line) for k, line in lines if line.strip()), None)
    if first is None:
        return []
    if file.suffix == ".json" and first[1].lstrip().startswith("["):
        return _json_array(file, decode(file))[:n]
    rest = ((k, line) for k, line in lines if line.strip())
    return [(k, _json_line(file, k, line)) for k, line in islice([first, *islice(rest, n - 1)], n)]


def read_splits(files: dict[str, Path], source: str) -> dict[str, Any]:
    """Each split's ``datasets.Dataset``: JSON through ``datasets``, CSV from the records as checked (strings).

    ``datasets``' CSV reader (pandas) would re-type what the check read as text: ``01`` -> 1, ``NA`` / ``null`` /
    an empty cell -> None, ``True`` -> a bool, and a column named twice renamed ``label.1``.
    """
    from datasets import Dataset, load_dataset

    jsons = {s: str(f) for s, f in files.items() if f.suffix != ".csv"}
    try:
        dd = dict(load_dataset("json", data_files=jsons)) if jsons else {}
    except Exception as exc:  # records passed the line check, so this is a schema clash between files
        raise DatasetError(f"{source}: datasets could not read the files ({type(exc).__name__}: {exc})") from exc
    for s, f in files.items():
        if f.suffix == ".csv":
            dd[s] = Dataset.from_list([r for _, r in read_records(f)])
    return {s: dd[s] for s in files}
