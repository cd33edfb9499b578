"""What the run form (Prefect's UI, and the server when a run is created from a deployment) checks before any work.

JSON-schema additions to :class:`symfuse.config.RunConfig`: a bad name, anchor or merge parameter is refused at
creation, not in the worker. The model's own validators still give the one-line messages everywhere else. Merge
strategies are the names of :data:`symfuse.merge.registry.MERGERS`, symmetries the kinds of
:mod:`symfuse.symmetry.registry`: read when the schema is built, so a strategy or kind registered later is a choice
too (the registries import no torch).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from symfuse.merge.registry import MERGERS
from symfuse.names import NAME_CHARS, NAME_MAX, NAME_RE, is_name

ANCHOR_POLICIES = ("closest", "barycenter")
NAME_SCHEMA = {"pattern": NAME_RE.pattern}
ANCHOR_SCHEMA = {"pattern": NAME_RE.pattern, "examples": list(ANCHOR_POLICIES)}  # or a dataset name


def check_name(value: str, what: str) -> str:
    """``value`` if it can name a run / dataset (it becomes a folder of artifact keys).

    Raises:
        ValueError: it cannot (``what`` names it in the message).
    """
    if is_name(value):
        return value
    shown = value if len(value) <= 40 else f"{value[:40]}... ({len(value)} characters)"
    raise ValueError(
        f"{what} {shown!r}: use 1-{NAME_MAX} {NAME_CHARS}, starting with a letter or digit (it becomes "
        "part of artifact keys)"
    )


def merge_params_schema(schema: dict[str, Any]) -> None:
    """``json_schema_extra`` of ``merge_params``: keys are strategies, each value that strategy's typed parameters."""
    schema["propertyNames"] = {"enum": list(MERGERS.names())}
    schema["properties"] = {name: MERGERS[name].Params.model_json_schema() for name in MERGERS.names()}
    schema["additionalProperties"] = False


def enum_of(names: Callable[[], Sequence[str]]) -> Callable[[dict[str, Any]], None]:
    """``json_schema_extra`` offering the registry's current ``names()`` as the list items' choices (UI form)."""

    def extra(schema: dict[str, Any]) -> None:
        schema["items"] = {**schema.get("items", {}), "enum": list(names())}

    return extra
