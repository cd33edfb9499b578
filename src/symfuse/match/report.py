"""The one report of an alignment: the keys every driver writes, then the driver's own.

``exact`` is always a bool: true when every transform is exact AND (``verified``) the WRITTEN folder, reloaded from
disk, computes the source's outputs within the stored dtype's tolerance (``tolerance``, ``max_abs_logit_diff``).
An exact alignment whose written folder misses the tolerance is refused before it is published, so a report never
says exact about a file that is not. A soft alignment (OT's transport maps) is never ``exact``; its difference is
measured all the same (``within_tolerance``). With ``verify: none`` nothing is reloaded: ``exact`` says what the
transforms are, ``verified`` is false and ``max_abs_logit_diff`` / ``within_tolerance`` are null.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from symfuse.match.output_check import logit_tolerance

# the keys every alignment report holds, in this order (drivers add theirs after them)
COMMON_KEYS = (
    "source", "anchor", "family", "symmetries", "driver", "device", "distance_before", "distance_after", "exact",
    "within_tolerance", "verified", "verify", "max_abs_logit_diff", "tolerance", "dtype", "checked", "seconds",
)  # fmt: skip


def dtype_name(dtype: torch.dtype) -> str:
    """``float32`` for ``torch.float32``."""
    return str(dtype).removeprefix("torch.")


def tolerance_text(dtype: torch.dtype) -> str:
    """The output check's tolerance for weights stored in ``dtype``, e.g. ``1e-04 x max |output| (float32)``."""
    return f"{logit_tolerance(dtype):.0e} x max |output| ({dtype_name(dtype)})"


def check_fields(
    exact: bool, verify: str, diff: float | None, within: bool | None, dtype: torch.dtype
) -> dict[str, Any]:
    """The report's check keys: ``exact``, ``within_tolerance``, ``verified``, ``max_abs_logit_diff``, ...

    Args:
        exact: Whether every transform is exact and (when verified) the written folder passed the check.
        verify: The check's mode (``stream``, ``full`` or ``none``).
        diff: The measured max |Δ output| of the written folder against the source (None: not verified).
        within: Whether ``diff`` is within the tolerance (None: not verified).
        dtype: The stored dtype the tolerance is taken from.
    """
    verified = verify != "none"
    return {
        "exact": bool(exact),
        "within_tolerance": within,
        "verified": verified,
        "verify": verify,
        "max_abs_logit_diff": float(diff) if diff is not None else None,
        "tolerance": tolerance_text(dtype),
        "dtype": dtype_name(dtype),
        "checked": "the written folder, reloaded" if verified else "the transforms only (--verify none)",
    }


def alignment_report(
    *,
    source: str,
    anchor: str,
    family: str,
    symmetries: Sequence[str],
    driver: str,
    device: str,
    distance_before: float,
    distance_after: float,
    check: Mapping[str, Any],
    seconds: float,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The report of one alignment: :data:`COMMON_KEYS` first, then ``extra`` (the driver's own keys).

    Args:
        source: The source checkpoint's folder.
        anchor: The anchor's folder.
        family: The model family.
        symmetries: The kinds asked for.
        driver: The finder that aligned it (``weights``, ``activations``, ``ot``, ``residual-orthogonal``).
        device: Where it ran.
        distance_before: Distance of the source to the anchor.
        distance_after: Distance of the written model to the anchor.
        check: :func:`check_fields` of the written folder.
        seconds: Wall time of the whole alignment.
        extra: The driver's own keys (they never replace a common one).
    """
    report = {
        "source": str(source), "anchor": str(anchor), "family": family, "symmetries": list(symmetries),
        "driver": driver, "device": str(device), "distance_before": float(distance_before),
        "distance_after": float(distance_after), **check, "seconds": float(seconds),
    }  # fmt: skip
    report.update({k: v for k, v in (extra or {}).items() if k not in report})
    return report
