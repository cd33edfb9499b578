"""mergekit's parameter gradients: a list of numbers interpolated over the layer stack.

In a mergekit config a parameter may be a list, ``t: [0, 0.5, 1]``: layer ``i`` of ``n`` reads it at position
``i / (n - 1)`` (``1`` when ``n == 1``), linearly between neighbouring entries; tensors outside the layer stack
(embeddings, final norm, heads) read it at position 0.

Source: mergekit 0.1.5, ``mergekit/config.py`` ``evaluate_setting`` (the interpolation) and ``mergekit/plan.py``
``MergePlanner.plan_slice`` / ``plan_module`` (the position of each layer; ``t=0`` for the pre and post weights).
Here the layer index is read from the stored tensor name (``...layers.3.``, ``...layer.3.``, ``...h.3.``,
``...block.3.``) and the layer count from model 0's tensor names.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Annotated, Any

from pydantic import PlainValidator

_LAYER = re.compile(r"(?:^|\.)(?:layers?|h|blocks?)\.(\d+)\.")


def _setting_check(lo: float, hi: float | None) -> Callable[[Any], float | list[float]]:
    """A validator of a number, or a non-empty list of numbers, each finite and in ``[lo, hi]``."""
    where = f"[{lo:g}, {hi:g}]" if hi is not None else f">= {lo:g}"

    def check(value: Any) -> float | list[float]:
        values = value if isinstance(value, list) else [value]
        if not values:
            raise ValueError("an empty list — give a number, or a list of numbers (a gradient over the layers)")
        out = []
        for x in values:
            if isinstance(x, bool) or not isinstance(x, (int, float)):
                raise ValueError(f"{x!r} is not a number — give a number, or a list of numbers")
            if not math.isfinite(x) or x < lo or (hi is not None and x > hi):
                raise ValueError(f"{x!r} is not in {where}")
            out.append(float(x))
        return out if isinstance(value, list) else out[0]

    return check


# parameters that are a number or a gradient list (mergekit's ScalarOrGradient), each value checked
UnitSetting = Annotated[float | list[float], PlainValidator(_setting_check(0.0, 1.0))]  # in [0, 1]
NonNegativeSetting = Annotated[float | list[float], PlainValidator(_setting_check(0.0, None))]  # >= 0


def layer_index(name: str) -> int | None:
    """The layer number in a stored tensor name (``bert.encoder.layer.3.output.dense.weight`` -> 3), else None."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def layer_count(names: Iterable[str]) -> int:
    """How many layers the named tensors span: the largest layer index plus one (0 when none is in a layer)."""
    return max((i + 1 for i in map(layer_index, names) if i is not None), default=0)


def layer_position(name: str, n_layers: int) -> float:
    """Where tensor ``name`` sits on the layer stack in [0, 1] (mergekit: 0 outside the stack, 1 for one layer)."""
    i = layer_index(name)
    if i is None:
        return 0.0
    return i / (n_layers - 1) if n_layers > 1 else 1.0


def evaluate_setting(setting: float | Sequence[float], position: float) -> float:
    """A scalar as is; a list read at ``position`` in [0, 1], linearly between neighbouring entries.

    mergekit's ``evaluate_setting`` for numbers: ``scaled = position * (len - 1)``, ``i0 = int(scaled)``,
    ``i1 = min(len - 1, i0 + 1)``, ``(1 - frac) * s[i0] + frac * s[i1]``.
    """
    if isinstance(setting, (int, float)):
        return float(setting)
    values = list(setting)
    scaled = position * (len(values) - 1)
    i0 = int(scaled)
    i1 = min(len(values) - 1, i0 + 1)
    frac = scaled - i0
    return (1 - frac) * float(values[i0]) + frac * float(values[i1])


def checkpoint_layer_count(folder: str | Path) -> int:
    """The layer count of a checkpoint folder, from its tensor names (reads the headers only)."""
    from symfuse.checkpoint import CheckpointReader

    with CheckpointReader(folder) as r:
        return layer_count(r.names())


class LayerGradient:
    """Per-tensor values of gradient parameters: set the layer count with :meth:`prepare`, then :meth:`value`."""

    def __init__(self) -> None:
        self.n_layers: int | None = None

    def prepare(self, models: Sequence[str | Path]) -> None:
        """Read the layer count from model 0's tensor names."""
        self.n_layers = checkpoint_layer_count(models[0]) if models else None

    def value(self, setting: float | Sequence[float], name: str, what: str) -> float:
        """``setting`` for tensor ``name``; a list needs the layer count (``what`` names the parameter in errors).

        Raises:
            ValueError: a list with no layer count (the merger was not prepared with the checkpoints).
        """
        if isinstance(setting, (int, float)):
            return float(setting)
        if self.n_layers is None:
            raise ValueError(
                f"{what}: a list (a gradient over the layers) needs the layer count — merge checkpoints with "
                "merge_checkpoints (it calls prepare), or call prepare(models) first, or give one number"
            )
        return evaluate_setting(setting, layer_position(name, self.n_layers))
