"""NearSwap: take the second model's value where it is close to the first's (mergekit's ``nearswap``).

With ``a`` the first ``--models`` entry (mergekit's ``base_model``) and ``b`` the second, per entry
``w = clamp(t / max(|a - b|, 1e-6), 0, 1)`` and the result ``w b + (1 - w) a``: entries that differ by at most
``t`` become ``b``'s, entries far apart stay near ``a``'s. ``t`` may be a list (a gradient over the layers,
:mod:`symfuse.merge.gradient`).

Source: mergekit 0.1.5, ``mergekit/merge_methods/nearswap.py`` ``nearswap_merge`` (``base_tensor`` is ``a``, the
other model's tensor ``b``). mergekit computes in the inputs' dtype; here in float32 (float64 for float64 inputs).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from symfuse.merge.base import Merger, TensorInputs, acc_dtype, load_all
from symfuse.merge.gradient import LayerGradient, NonNegativeSetting
from symfuse.merge.registry import UnweightedParams


def nearswap(t: float, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``w b + (1 - w) a`` with ``w = clamp(t / max(|a - b|, 1e-6), 0, 1)`` per entry.

    Args:
        t: The similarity threshold (an absolute difference).
        a: The base tensor (mergekit's ``base_tensor``).
        b: The other tensor.

    Returns:
        A new tensor of ``a``'s shape, dtype and device.
    """
    dt = acc_dtype(a)
    x, y = a.to(dt), b.to(dt)
    w = (t / (x - y).abs().clamp(min=1e-6)).clamp(min=0, max=1)
    return (w * y + (1 - w) * x).to(a.dtype)


class NearSwapParams(UnweightedParams):
    """NearSwap parameters (mergekit's names)."""

    t: NonNegativeSetting  # the swap threshold (required, as in mergekit)


class NearSwapMerger(Merger):
    """NearSwap of two models: the second model's entries that lie within ``t`` of the first's."""

    name = "nearswap"
    model_count = (2, 2)
    Params = NearSwapParams

    def __init__(self, **params: Any):
        super().__init__(**params)
        self.gradient = LayerGradient()

    def prepare(self, models: Sequence[Any], keep: frozenset[str] = frozenset()) -> None:
        """Read the layer count when ``t`` is a gradient over the layers."""
        if isinstance(self.params.t, list):  # type: ignore[attr-defined]
            self.gradient.prepare([Path(m) for m in models])

    def merge_tensor(self, t: TensorInputs) -> torch.Tensor:
        """``nearswap(t, first, second)`` with ``t`` read at this tensor's layer."""
        if len(t.tensors) == 1:  # one model holds this part (a head row): mergekit returns it
            return t.tensors[0].clone()
        self.check_model_count(len(t.tensors))
        a, b = load_all(t.tensors, self.pool, "nearswap", None)
        return nearswap(self.gradient.value(self.params.t, t.name, "nearswap t"), a, b)  # type: ignore[attr-defined]
