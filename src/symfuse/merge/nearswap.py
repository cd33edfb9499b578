"""NearSwap: take the second model's value where it is close to the first's (mergekit's ``nearswap``).

With ``a`` the first ``--models`` entry (mergekit's ``base_model``) and ``b`` the second, per entry
``w = clamp(t / max(|a - b|, 1e-6), 0, 1)`` and the result ``w b + (1 - w) a``: entries that differ by at most
``t`` become ``b``'s, entries far apart stay near ``a``'s. ``t`` may be a list (a gradient over the layers,
:mod:`symfuse.merge.gradient`).

Source: mergekit 0.1.5, ``mergekit/merge_methods/nearswap.py`` ``nearswap_merge`` (``base_tensor`` is ``a``, the
other model's tensor ``b``). mergekit computes in the inputs' dtype; here in float32 (float64 for float64 inputs).
"""

from __future__ import annotations

import torch

from symfuse.merge.base import acc_dtype
from symfuse.merge.gradient import NonNegativeSetting
from symfuse.merge.pairwise import PairMerger
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


class NearSwapMerger(PairMerger):
    """NearSwap of two models: the second model's entries that lie within ``t`` of the first's."""

    name = "nearswap"
    Params = NearSwapParams

    def combine(self, t: float, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
        """``nearswap(t, first, second)``."""
        return nearswap(t, first, second)
