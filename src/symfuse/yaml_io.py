"""The one YAML loader for files people write (run configs, merge files) and the family files.

It is PyYAML's safe loader refusing a mapping key given twice: plain YAML keeps the last value silently, so a file
saying ``strategy: simple`` and later ``strategy: ties`` would run one of the two without a word. Keys brought in by
a merge key (``<<: *defaults``) may still be overridden. ``load(text, fast=True)`` parses with libyaml where PyYAML
was built with it (the families parse in ~10 ms instead of ~140 ms); the pure-Python parser's syntax errors say what
it found (``expected ',' or ']', but got ':'``), so a person's file gets it; :func:`read_file` reads such a file,
its errors naming the line. It imports only yaml and the standard library.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

_MERGE_TAG = "tag:yaml.org,2002:merge"


class DuplicateKeyError(yaml.constructor.ConstructorError):
    """A mapping gives one key twice; ``str()`` is ``line L: key 'K' given twice (first at line F) — keep one``."""

    def __init__(self, key: Any, first: yaml.Node, again: yaml.Node) -> None:
        super().__init__(problem=f"key {key!r} given twice", problem_mark=again.start_mark)
        self.key, self.line, self.first_line = key, again.start_mark.line + 1, first.start_mark.line + 1

    def __str__(self) -> str:
        return f"line {self.line}: key {self.key!r} given twice (first at line {self.first_line}) — keep one"


def _construct_mapping(self: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    """``SafeLoader.construct_mapping`` once the mapping's own keys are known to be distinct.

    Raises:
        DuplicateKeyError: a key written twice in this mapping (values from merge keys excepted).
    """
    if isinstance(node, yaml.MappingNode):  # before the merge keys are flattened into node.value
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG:
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node)
            except TypeError:  # an unhashable key: the base constructor says so
                continue
            if first is not key_node:
                raise DuplicateKeyError(key, first, key_node)
    return yaml.SafeLoader.construct_mapping(self, node, deep=deep)


class Loader(yaml.SafeLoader):
    """The safe loader (pure-Python parser) that refuses a mapping key given twice."""

    construct_mapping = _construct_mapping


class FastLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
    """:class:`Loader` on libyaml's parser where PyYAML has it (same documents, terser syntax errors)."""

    construct_mapping = _construct_mapping


def load(text: str | bytes, fast: bool = False) -> Any:
    """The one YAML document in ``text`` (None when empty).

    Args:
        text: the document.
        fast: parse with libyaml where available (bundled files; a person's file gets the clearer syntax errors).

    Returns:
        The document as plain Python values.

    Raises:
        DuplicateKeyError: a mapping gives one key twice.
        yaml.YAMLError: the text is not YAML, or holds a tag the safe loader refuses.
    """
    return yaml.load(text, Loader=FastLoader if fast else Loader)  # both are safe loaders


def read_file(path: str | os.PathLike) -> Any:
    """The YAML document in ``path`` (a run config, a merge file).

    Raises:
        FileNotFoundError: the file is absent.
        ValueError: ``<path>: not valid YAML at line L, column C (<problem>) — fix the syntax there`` (bytes that are
            not UTF-8 likewise name their line; a mapping key given twice names both lines).
    """
    data = Path(path).read_bytes()
    try:
        return load(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ValueError(f"{path}: not UTF-8 at line {line} — re-save it as UTF-8 text") from exc
    except DuplicateKeyError as exc:
        raise ValueError(f"{path}: {exc}") from exc
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ValueError(f"{path}: not valid YAML{where} ({problem}) — fix the syntax there") from exc
