"""``true`` / ``false`` is not a number: a before-validator that every config model of the library shares.

Pydantic's lax mode takes ``density: true`` as ``1.0`` and ``epochs: false`` as ``0``; YAML, JSON and the Prefect
form make that an easy slip (a flag where a number was meant), and the run would go ahead with a value nobody
wrote. :func:`no_bool_for_numbers` refuses a boolean, alone or inside a list, wherever the field's type takes numbers
and not booleans. Use it as ``_no_bool = field_validator("*", mode="before")(no_bool_for_numbers)``.
"""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import ValidationInfo

_SEQUENCES = (list, tuple, set, frozenset)


def no_bool_for_numbers(cls: type, value: Any, info: ValidationInfo) -> Any:
    """``value`` unchanged, unless it is (or holds) a boolean where the field takes numbers but not booleans.

    Raises:
        ValueError: ``a number, not true/false`` (``numbers, ...`` for a list).
    """
    field = cls.model_fields.get(info.field_name or "")  # type: ignore[attr-defined]
    if field is not None and _bool_where_number(value, field.annotation):
        raise ValueError("a number, not true/false" if isinstance(value, bool) else "numbers, not true/false")
    return value


def _bool_where_number(value: Any, annotation: Any) -> bool:
    if isinstance(value, bool):
        kinds = _leaf_types(annotation)
        return bool(kinds & {int, float}) and bool not in kinds and Any not in kinds
    if isinstance(value, _SEQUENCES):
        items = [arg for alt in _alternatives(annotation) if typing.get_origin(alt) in _SEQUENCES for arg in _args(alt)]
        return any(_bool_where_number(v, item) for v in value for item in items)
    return False


def _alternatives(annotation: Any) -> tuple[Any, ...]:
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _alternatives(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return tuple(a for arg in typing.get_args(annotation) for a in _alternatives(arg))
    return (annotation,)


def _leaf_types(annotation: Any) -> set[Any]:
    return {alt if typing.get_origin(alt) is None else typing.get_origin(alt) for alt in _alternatives(annotation)}


def _args(annotation: Any) -> tuple[Any, ...]:
    return tuple(arg for arg in typing.get_args(annotation) if arg is not Ellipsis)


def deployment_name(cls: type, value: str) -> str:
    """A field validator: ``value`` is ``<flow name>/<deployment name>``, as Prefect's ``run_deployment`` takes it."""
    flow, _, deployment = value.partition("/")
    if not flow.strip() or not deployment.strip() or "/" in deployment:
        raise ValueError(f"{value!r}: expected <flow name>/<deployment name>, e.g. finetune-stage/finetune-stage")
    return value
