"""A named registry of plug-ins, readable without importing torch.

Used by :mod:`symfuse.merge.registry` (merge strategies) and :mod:`symfuse.symmetry.registry` (symmetry kinds):
the names are known at import (the CLI and the run config check them before torch is loaded), the implementations
may be given as ``"package.module:attribute"`` strings that are imported on first use.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Generic, TypeVar

from symfuse.errors import UnknownChoiceError

T = TypeVar("T")


def resolve(ref: Any) -> Any:
    """``ref`` itself, or the object a ``"package.module:attribute"`` string names (imported now)."""
    if not isinstance(ref, str):
        return ref
    module, sep, attr = ref.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"{ref!r}: expected 'package.module:attribute'")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


class Registry(Mapping[str, T], Generic[T]):
    """Name -> plug-in, in registration order; entries given as import strings are imported on first access.

    Args:
        what: What the entries are, for messages (``"merge strategy"``).
        check: Called on each resolved entry with its registered name; raises if the entry does not fit.
    """

    def __init__(self, what: str, check: Callable[[str, Any], T] | None = None):
        self.what = what
        self._check = check
        self._entries: dict[str, Any] = {}

    def register(self, name: str, entry: T | str) -> T | str:
        """Add ``entry`` (an object, or an import string) under ``name``; return ``entry``.

        Raises:
            ValueError: ``name`` is taken (unregister it first) or empty.
        """
        if not name or not isinstance(name, str):
            raise ValueError(f"a {self.what} needs a non-empty name, got {name!r}")
        if name in self._entries:
            raise ValueError(f"{self.what} {name!r} is already registered; unregister it first")
        if not isinstance(entry, str) and self._check is not None:
            entry = self._check(name, entry)
        self._entries[name] = entry
        return entry

    def unregister(self, name: str) -> None:
        """Remove ``name`` (e.g. a test's toy entry); an unknown name is refused like in :meth:`__getitem__`."""
        self.require([name])
        del self._entries[name]

    def names(self) -> tuple[str, ...]:
        """Registered names, in registration order (no import)."""
        return tuple(self._entries)

    def require(self, names: Iterable[str], what: str | None = None) -> list[str]:
        """``names`` as a list, or one line naming the unknown ones and every choice.

        Raises:
            UnknownChoiceError: some names are not registered.
        """
        names = list(names)
        unknown = [n for n in names if n not in self._entries]
        if unknown:
            label = what or f"{self.what}{'s' if len(unknown) > 1 else ''}"
            raise UnknownChoiceError(
                f"unknown {label} {', '.join(map(repr, unknown))} — choose from {', '.join(self._entries)}"
            )
        return names

    def __getitem__(self, name: str) -> T:
        self.require([name])
        entry = self._entries[name]
        if isinstance(entry, str):
            entry = resolve(entry)
            if self._check is not None:
                entry = self._check(name, entry)
            self._entries[name] = entry
        return entry

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.what!r}, {list(self._entries)})"
