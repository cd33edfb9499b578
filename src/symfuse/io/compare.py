"""Whether two checkpoints hold the same tensors (names and shapes), from their headers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def tensor_difference(a: Any, b: Any, skip: Callable[[Any, str], bool] = lambda reader, name: False) -> str | None:
    """Where two checkpoints' tensors first differ, naming both; None when names and shapes agree.

    Args:
        a: A reader (``path``, ``names()``, ``shape(name)``; :class:`~symfuse.checkpoint.CheckpointReader`).
        b: Another reader.
        skip: ``skip(reader, name)`` leaves a tensor out of the comparison (heads kept per model).

    Returns:
        ``"<b>: a <family> model, <a> a <family> model"`` (readers with a ``spec``), ``"<b>: tensors differ from <a>
        (e.g. [...])"`` or ``"<b>: <name> has shape (...), <a> (...)"``, or None.
    """
    families = [getattr(getattr(r, "spec", None), "family", None) for r in (a, b)]
    if None not in families and families[0] != families[1]:  # every tensor differs: say why, not which
        return f"{b.path}: a {families[1]} model, {a.path} a {families[0]} model"
    body = [n for n in a.names() if not skip(a, n)]
    other = {n for n in b.names() if not skip(b, n)}
    if other != set(body):
        return f"{b.path}: tensors differ from {a.path} (e.g. {sorted(other.symmetric_difference(body))[:5]})"
    for n in body:
        if b.shape(n) != a.shape(n):
            return f"{b.path}: {n} has shape {b.shape(n)}, {a.path} {a.shape(n)}"
    return None
