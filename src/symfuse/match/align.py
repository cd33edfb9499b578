"""One alignment path: a plan picks the driver ("finder"), one writer publishes what it wrote.

:func:`plan_alignment` picks the finder for the asked kinds; :func:`align_checkpoints` runs its step through the one
writer (:func:`symfuse.match.publish.publish_alignment`).

The finders, in order of precedence (the first whose predicate holds aligns; its validation refuses the mixes it
cannot take, in one line):

* ``ot``: an OT kind (``ot``, ``ot-soft``, ``ot-acts``, ``ot-acts-soft``), the whole model by transport plans,
  optionally with rotation, scaling (:mod:`symfuse.match.ot_checkpoints`);
* ``residual-orthogonal``: one orthogonal map of the stream alternated with per-module maps
  (:mod:`symfuse.match.residual_orthogonal`);
* ``activations``: ``--data`` given: permutations from activation statistics (:mod:`symfuse.match.activation`);
* ``weights``: the rest, streamed module by module (:mod:`symfuse.match.checkpoints`).

This module imports no torch (the CLI plans before torch loads); a new finder plugs in with :func:`register_finder`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from symfuse.errors import UsageError
from symfuse.registry import Registry, resolve
from symfuse.symmetry.registry import SYMMETRY_KINDS, check_kinds

OT_KINDS = ("ot", "ot-soft", "ot-acts", "ot-acts-soft")  # symfuse.match.ot.OT_KINDS, named before torch loads
OT_EXTRAS = ("rotation", "scaling")  # exact per-head maps OT takes after its transport
RESIDUAL_ORTHOGONAL = "residual-orthogonal"


@dataclass(frozen=True)
class Finder:
    """A driver of :func:`align_checkpoints`.

    Attributes:
        name: The driver's name (the report's ``driver``).
        selects: ``(kinds, has_data) -> bool``: whether this finder aligns them (the first registered that does).
        validate: ``(kinds, has_data) -> options``: refuses, in one :class:`UsageError` line, what it cannot take;
            returns the driver's options (e.g. ``ot_kind``).
        inner: ``kinds -> kinds`` its step finds (its own name left out).
        step: Its :data:`symfuse.match.publish.Step`, or a ``"package.module:function"`` string (imported on use).
    """

    name: str
    selects: Callable[[Sequence[str], bool], bool]
    validate: Callable[[Sequence[str], bool], dict[str, Any]]
    inner: Callable[[Sequence[str]], tuple[str, ...]]
    step: Any


@dataclass(frozen=True)
class AlignmentPlan:
    """What :func:`plan_alignment` decided.

    Attributes:
        driver: The finder's name.
        kinds: Every kind asked for.
        inner: The kinds the driver's step finds.
        data: The dataset (None: from the weights).
        refine: residual-orthogonal's refinement steps.
        options: The driver's options.
    """

    driver: str
    kinds: tuple[str, ...]
    inner: tuple[str, ...]
    data: str | None = None
    refine: int = 0
    options: dict[str, Any] = field(default_factory=dict)


FINDERS: Registry[Finder] = Registry("alignment finder")


def register_finder(finder: Finder, before: str | None = None) -> Finder:
    """Add ``finder`` (last, or just ahead of the finder named ``before`` in precedence)."""
    if before is None:
        return FINDERS.register(finder.name, finder)
    order = [FINDERS[n] for n in FINDERS]
    FINDERS.require([before])
    for name in list(FINDERS):
        FINDERS.unregister(name)
    for f in order:
        if f.name == before:
            FINDERS.register(finder.name, finder)
        FINDERS.register(f.name, f)
    return finder


def ot_kind(kinds: Sequence[str], has_data: bool) -> dict[str, Any]:
    """The OT kind among ``kinds`` (``{"ot_kind": ...}``); refuses mixes OT does not take, in one line."""
    found = [n for n in kinds if n in OT_KINDS]
    other = [n for n in kinds if n not in OT_KINDS and n not in OT_EXTRAS]
    if len(found) != 1 or other:
        raise UsageError(
            f"--symmetries: {', '.join(found + other)} do not combine — OT fusion takes ONE of "
            f"{', '.join(OT_KINDS)} (it replaces the permutations), optionally with {', '.join(OT_EXTRAS)}"
        )
    kind = found[0]
    if "acts" in kind and not has_data:
        raise UsageError(f"--symmetries: {kind} aligns by activations — give --data DATASET")
    if "acts" not in kind and has_data:
        raise UsageError(f"--data: {kind} aligns by weights and reads no data — use {kind.replace('ot', 'ot-acts')}")
    return {"ot_kind": kind}


def registered_kinds(kinds: Sequence[str], has_data: bool) -> dict[str, Any]:
    """Registered kinds that go together; those found from activations only need data.

    Raises:
        UsageError: an unknown kind, two that exclude each other, or an activations-only kind without data.
    """
    try:
        check_kinds(kinds, "activations")
    except ValueError as exc:  # unknown names, kinds that exclude each other
        raise UsageError(f"--symmetries: {exc}") from exc
    from_data = [n for n in kinds if not SYMMETRY_KINDS[n].offers("weights")]
    if not has_data and from_data:
        raise UsageError(f"--symmetries: {', '.join(from_data)} is found from activations — give --data DATASET")
    return {}


def _without(*names: str) -> Callable[[Sequence[str]], tuple[str, ...]]:
    return lambda kinds: tuple(k for k in kinds if k not in names)


def _has_ot(kinds: Sequence[str], has_data: bool) -> bool:
    return any(k in OT_KINDS for k in kinds)


def _has_residual_orthogonal(kinds: Sequence[str], has_data: bool) -> bool:
    return RESIDUAL_ORTHOGONAL in kinds


def _has_data(kinds: Sequence[str], has_data: bool) -> bool:
    return has_data


def _always(kinds: Sequence[str], has_data: bool) -> bool:
    return True


register_finder(Finder("ot", _has_ot, ot_kind, _without(*OT_KINDS), "symfuse.match.ot_checkpoints:ot_step"))
register_finder(
    Finder(RESIDUAL_ORTHOGONAL, _has_residual_orthogonal, registered_kinds, _without(RESIDUAL_ORTHOGONAL),
           "symfuse.match.residual_orthogonal:residual_orthogonal_step"),
)  # fmt: skip
register_finder(Finder("activations", _has_data, registered_kinds, tuple, "symfuse.match.activation:activation_step"))
register_finder(Finder("weights", _always, registered_kinds, tuple, "symfuse.match.checkpoints:weights_step"))


def plan_alignment(kinds: Sequence[str], data: str | None = None, refine: int = 0) -> AlignmentPlan:
    """Which finder aligns ``kinds`` (with ``data`` or not), after its validation; no torch, no model read.

    Raises:
        UsageError: one line: kinds that do not combine, activation kinds without data, ``refine`` without
            residual-orthogonal and data.
    """
    kinds = tuple(kinds)
    if not kinds:
        raise UsageError("--symmetries: names nothing — give at least one symmetry kind")
    has_data = data is not None
    finder = next(FINDERS[n] for n in FINDERS if FINDERS[n].selects(kinds, has_data))
    options = finder.validate(kinds, has_data)
    if refine and (RESIDUAL_ORTHOGONAL not in kinds or not has_data):
        raise UsageError("--refine: refines residual-orthogonal's map on data — add residual-orthogonal and --data")
    return AlignmentPlan(finder.name, kinds, finder.inner(kinds), data, refine, dict(options))


def align_checkpoints(
    source: str | Path,
    anchor: str | Path,
    out: str | Path,
    kinds: Sequence[str],
    data: str | None = None,
    *,
    max_examples: int | None = 64,
    refine: int = 0,
    workers: int | None = None,
    verify: str | None = None,
    device: Any = "auto",
    overwrite: bool = False,
) -> dict:
    """Align SOURCE to ANCHOR by ``kinds`` and write OUT: the one entry of every alignment.

    The plan (:func:`plan_alignment`) picks the finder; its step writes into a temporary folder, which is checked
    as written (reloaded), reported (:func:`symfuse.match.report.alignment_report`) and published.

    Args:
        source: Model to align (folder, ``"minilm"`` or hub id).
        anchor: Model to align it to (same family and shapes).
        out: Output folder (must not exist unless ``overwrite``).
        kinds: Symmetry kinds, or one OT kind (with rotation, scaling).
        data: Dataset feeding both models (``random-pixels`` for pixel families); None: from the weights.
        max_examples: Examples for the statistics.
        refine: residual-orthogonal's refinement steps on ``data``.
        workers: Modules matched in parallel (weights).
        verify: ``stream`` (default), ``full`` or ``none`` (drivers holding both models whole check ``full``).
        device: ``auto``, ``cpu``, ``cuda``, ``cuda:N``.
        overwrite: Replace an existing ``out`` (atomically, at the end).

    Returns:
        The report.

    Raises:
        UsageError: a plan refused (see :func:`plan_alignment`).
        VerificationError: the written folder of an exact alignment does not compute SOURCE's function (nothing
            published).
    """
    from symfuse.device import resolve_device
    from symfuse.match.publish import AlignRequest, publish_alignment, verify_mode

    plan = plan_alignment(kinds, data, refine)
    request = AlignRequest(
        source, anchor, Path(out), plan.inner, data, max_examples, refine, workers, verify_mode(verify),
        resolve_device(device), overwrite, dict(plan.options),
    )  # fmt: skip
    return publish_alignment(request, plan.driver, resolve(FINDERS[plan.driver].step))
