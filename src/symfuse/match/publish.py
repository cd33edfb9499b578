"""The one writer of every alignment: a driver's step writes, the folder is checked as WRITTEN, reported, published.

The step writes into a temporary folder, which is checked reloaded from disk, reported by
:func:`symfuse.match.report.alignment_report` and only then published.

A step (``Step``) is what differs between drivers: it finds the transforms, writes the aligned checkpoint and its
transform files into the folder it is given, and says what it did (:class:`Found`). Everything after it is shared.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from symfuse.match.inputs import REPORT_FILE
from symfuse.match.output_check import VERIFY_MODES, StreamedReference
from symfuse.match.report import alignment_report
from symfuse.match.written import check_written
from symfuse.outputs import atomic_output_dir, check_output

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AlignRequest:
    """What an alignment was asked for (every driver reads the fields it needs).

    Attributes:
        source: Model to align (folder, ``"minilm"`` or hub id).
        anchor: Model to align it to.
        out: Output folder.
        kinds: The symmetry kinds the driver finds (the driver's own name left out: ``residual-orthogonal``'s
            per-module kinds, OT's extra rotation / scaling).
        data: Dataset feeding both models (``random-pixels`` for pixel families); None: from the weights.
        max_examples: Examples for the statistics.
        refine: residual-orthogonal's refinement steps.
        workers: Modules matched in parallel (weights).
        verify: ``stream``, ``full`` or ``none``.
        device: Where the work runs.
        overwrite: Replace an existing ``out`` (atomically, at the end).
        options: Driver-specific settings (``ot_kind``, ``residual_strategy``, ``batch_size``, ``iters`` ...).
    """

    source: str | Path
    anchor: str | Path
    out: Path
    kinds: tuple[str, ...] = ()
    data: str | None = None
    max_examples: int | None = 64
    refine: int = 0
    workers: int | None = None
    verify: str = "stream"
    device: str | torch.device = "cpu"
    overwrite: bool = False
    options: dict[str, Any] = field(default_factory=dict)

    def option(self, name: str, default: Any) -> Any:
        """A driver-specific setting, or ``default``."""
        return self.options.get(name, default)


@dataclass
class Found:
    """What a driver's step wrote (the common report keys it knows) and how its folder is to be checked.

    Attributes:
        source: The source's folder.
        anchor: The anchor's folder.
        family: The model family.
        symmetries: The kinds found (as the report lists them).
        exact: Whether every transform is exact (a soft OT map is not).
        distance_before: Distance of the source to the anchor.
        distance_after: Distance of the aligned model to the anchor.
        dtype: The stored dtype (the check's tolerance).
        device: Where it ran.
        verify: How the written folder is checked (``stream``, ``full`` or ``none``).
        reference: SOURCE's streamed outputs already under way (``stream``), closed after the check.
        extra: The driver's own report keys.
    """

    source: str
    anchor: str
    family: str
    symmetries: Sequence[str]
    exact: bool
    distance_before: float
    distance_after: float
    dtype: torch.dtype
    device: str
    verify: str
    reference: StreamedReference | None = None
    extra: dict[str, Any] = field(default_factory=dict)


Step = Callable[[AlignRequest, Path], Found]


def verify_mode(verify: str | None) -> str:
    """``verify`` checked (None: ``stream``).

    Raises:
        ValueError: not one of :data:`symfuse.match.output_check.VERIFY_MODES`.
    """
    if verify is None:
        return "stream"
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify must be one of {', '.join(VERIFY_MODES)}, got {verify!r}")
    return verify


def whole_model_mode(verify: str) -> str:
    """The check of a driver holding both models whole: ``full`` (models this size load whole), or ``none``."""
    return "none" if verify == "none" else "full"


def _check(found: Found, tmp: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        check = check_written(tmp, found.source, found.exact, found.verify, found.dtype, found.reference)
    finally:
        if found.reference is not None:
            found.reference.close()
    timings = found.extra.get("timings")
    if isinstance(timings, dict):
        timings["verify"] = time.perf_counter() - t0
    return check


def publish_alignment(request: AlignRequest, driver: str, step: Step) -> dict[str, Any]:
    """Run ``step`` into a temporary folder next to ``request.out``, check it as written, report, publish.

    Args:
        request: The alignment asked for.
        driver: The driver's name (the report's ``driver``).
        step: The driver's step.

    Returns:
        The report (also written as ``symfuse_report.json`` in the published folder).

    Raises:
        OutputExistsError: ``out`` exists and ``overwrite`` is False.
        VerificationError: the written folder of an exact alignment does not compute SOURCE's function (nothing is
            published).
    """
    t0 = time.perf_counter()
    inputs = [request.source, request.anchor, request.data]
    out = check_output(request.out, request.overwrite, inputs)
    with atomic_output_dir(out, overwrite=request.overwrite, inputs=inputs) as tmp:
        found = step(request, tmp)
        check = _check(found, tmp)
        report = alignment_report(
            source=found.source, anchor=found.anchor, family=found.family, symmetries=found.symmetries,
            driver=driver, device=found.device, distance_before=found.distance_before,
            distance_after=found.distance_after, check=check, seconds=time.perf_counter() - t0, extra=found.extra,
        )  # fmt: skip
        (tmp / REPORT_FILE).write_text(json.dumps(report, indent=2))
    log.info("%s alignment %s -> %s: distance %.4g -> %.4g, exact %s", driver, found.source, found.anchor,
             report["distance_before"], report["distance_after"], report["exact"])  # fmt: skip
    return report
