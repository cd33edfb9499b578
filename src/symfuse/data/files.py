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
from collections.abc import Iterable, Iterator
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


def _json_line(file: Path, lineno: int, line: str) -> dict[str, Any]:
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{file}:{lineno}: not valid JSON ({exc.msg}); fix or remove that line") from exc
    if not isinstance(rec, dict):
        raise DatasetError(
            f"{file}:{lineno}: expected a JSON object, got {type(rec).__name__} — write one object per line, e.g. "
            '{"text": "...", "label": "joy"}'
        )
    return rec


def _json_array(file: Path, text: str) -> list[tuple[int, dict[str, Any]]]:
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{file}:{exc.lineno}: not valid JSON ({exc.msg})") from exc
    return [(i + 1, r) for i, r in enumerate(rows)]


def read_records(file: Path) -> list[tuple[int, dict[str, Any]]]:
    """``(line number, record)`` for each record of a JSON Lines / JSON array / CSV file.

    Raises:
        DatasetError: bytes that are not UTF-8, or a line that is not a JSON object (file and line named).
    """
    text = decode(file)
    if file.suffix == ".csv":
        return list(enumerate(csv.DictReader(io.StringIO(text, newline="")), start=2))
    if file.suffix == ".json" and text.lstrip().startswith("["):
        return _json_array(file, text)
    return [(n, _json_line(file, n, line)) for n, line in enumerate(text.splitlines(), start=1) if line.strip()]


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
        text = "".join(line for _, line in islice(_lines(file), n + 1))
        return list(enumerate(csv.DictReader(io.StringIO(text, newline="")), start=2))[:n]
    lines = _lines(file)
    first = next(((k, line) for k, line in lines if line.strip()), None)
    if first is None:
        return []
    if file.suffix == ".json" and first[1].lstrip().startswith("["):
        return _json_array(file, decode(file))[:n]
    rest = ((k, line) for k, line in lines if line.strip())
    return [(k, _json_line(file, k, line)) for k, line in islice([first, *islice(rest, n - 1)], n)]
