"""The merge strategies: one registry read by the run config, ``symfuse merge``, the merge task and the pipeline.

A strategy is a :class:`symfuse.merge.base.Merger` subclass declaring ``name``, ``required_stats`` (statistics
kinds it reads), ``needs_base`` (task vectors) and ``Params``, a pydantic :class:`MergeParams` subclass holding
its typed parameters (``extra="forbid"``; constraints as ``Field(ge=..., le=...)``). Parameters travel as one
generic ``{name: value}`` mapping: ``RunConfig.merge_params[strategy]``, ``symfuse merge --param NAME=VALUE`` (or a
flag of the same name, or ``params:`` in merge.yaml) and ``merge_checkpoints(strategy, ..., **params)`` are all
validated by :func:`merger_params`, so a new parameter is one field of its ``Params``.

How to add a strategy (its own file plus one registration line):

1. ``src/symfuse/merge/<name>.py``: ``class <Name>Params(MergeParams)`` with its fields, and
   ``class <Name>Merger(Merger)`` with ``name = "<name>"``, ``required_stats``, ``needs_base``,
   ``Params = <Name>Params`` and ``merge_tensor(self, t: TensorInputs) -> torch.Tensor`` (a NEW tensor); a
   merger that needs values of the run (each model's dataset, the statistics sample size, the device) names those
   ``Params`` fields in ``run_params`` and the merge task fills them (``tasks.merge.run_context``).
2. One line at the end of this module::

       register_merger("symfuse.merge.<name>:<Name>Merger", name="<name>")

   (an import string keeps this module free of torch: the CLI and the config check names before torch loads).
   A plug-in or a test registers the class itself, ``register_merger(MyMerger)``, and may
   ``unregister_merger("<name>")`` afterwards.

This module imports only pydantic: ``MERGERS.names()`` never imports torch; ``MERGERS[name]`` imports the class.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from symfuse.fields import no_bool_for_numbers
from symfuse.registry import Registry


class MergeParams(BaseModel):
    """Parameters shared by every merger; subclasses add their own (unknown keys are an error)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # a NaN bound read as "less than 1"
    _no_bool = field_validator("*", mode="before")(no_bool_for_numbers)

    weights: list[float] | None = None  # per-model weights (normalised to sum 1); default uniform


class UnweightedParams(MergeParams):
    """Parameters of a strategy that takes no model weights (its own parameters set the mix: slerp's ``t``)."""

    @field_validator("weights", mode="before")
    @classmethod
    def _no_weights(cls, value: Any) -> None:
        if value is not None:
            raise ValueError("this strategy takes no model weights (its own parameters set the mix); drop them")


def _check_merger(name: str, cls: Any) -> Any:
    """``cls`` if it is a merger class registered under its own ``name``."""
    params = getattr(cls, "Params", None)
    if not (isinstance(cls, type) and callable(getattr(cls, "merge_tensor", None))):
        raise TypeError(f"merge strategy {name!r}: {cls!r} is not a Merger class (no merge_tensor)")
    if getattr(cls, "name", None) != name:
        raise ValueError(f"merge strategy {name!r}: the class {cls.__name__} is named {getattr(cls, 'name', None)!r}")
    if not (isinstance(params, type) and issubclass(params, MergeParams)):
        raise TypeError(f"merge strategy {name!r}: {cls.__name__}.Params must subclass MergeParams")
    return cls


MERGERS: Registry[Any] = Registry("merge strategy", _check_merger)


def register_merger(merger: Any, name: str | None = None) -> Any:
    """Register a merger class (named by its ``name``), or an import string ``"module:Class"`` with ``name``.

    Returns:
        ``merger`` (so it can decorate a class).

    Raises:
        ValueError: the name is taken, or an import string comes without ``name``.
    """
    if name is None:
        if isinstance(merger, str):
            raise ValueError(f"register_merger({merger!r}): give name= with an import string")
        name = getattr(merger, "name", None)
    MERGERS.register(name, merger)  # type: ignore[arg-type]
    return merger


def unregister_merger(name: str) -> None:
    """Remove a registered strategy (a test's toy one)."""
    MERGERS.unregister(name)


# Parameters that were removed, with why: an older run config or merge file still carrying one is refused by name.
OUT_DTYPE_NAMES = ("float32", "float16", "bfloat16", "float64")  # what a merge may write its floating tensors in
RETIRED_PARAMS = {"linalg": "RegMean's BLAS / LAPACK vendor switch was removed; it always uses torch's"}


def param_names(params: type[BaseModel]) -> list[str]:
    """The parameter names a user writes for ``params`` (a field's alias where it has one: ``lambda``)."""
    return [f.alias or k for k, f in params.model_fields.items()]


def merger_params(strategy: str, values: Mapping[str, Any], label: Callable[[str], str] = str) -> BaseModel:
    """``values`` validated as ``strategy``'s typed parameters.

    Args:
        strategy: A registered strategy name.
        values: ``{parameter: value}`` (YAML / JSON scalars are coerced by pydantic).
        label: How a parameter is named in messages (``lambda k: f"--{k}"`` for the CLI).

    Returns:
        The ``Params`` instance (``model_dump(exclude_unset=True)`` gives back what was given).

    Raises:
        UnknownChoiceError: unknown strategy.
        ValueError: one line naming the first bad parameter, what is wrong and the fix.
    """
    params = MERGERS[strategy].Params
    for key in values:
        if key in RETIRED_PARAMS and key not in params.model_fields:
            raise ValueError(f"{label(key)}: no longer a parameter ({RETIRED_PARAMS[key]}) — remove it")
    try:
        return params.model_validate(dict(values))
    except ValidationError as exc:
        e = sorted(exc.errors(), key=lambda e: e["type"] != "extra_forbidden")[0]
        if not e["loc"]:  # a check across parameters (a model validator): its message names them
            raise ValueError(f"strategy {strategy}: {str(e['msg']).removeprefix('Value error, ')}") from None
        key = ".".join(map(str, e["loc"]))
        if e["type"] == "extra_forbidden":
            fields = ", ".join(param_names(params))
            raise ValueError(f"{label(key)}: not a parameter of strategy {strategy} — choose from {fields}") from None
        if e["type"] == "missing":
            raise ValueError(f"{label(key)}: missing — strategy {strategy} needs it; give its value") from None
        msg = e["msg"].removeprefix("Value error, ")
        raise ValueError(f"{label(key)}: {msg} (got {e.get('input')!r}) — fix its value") from None


# the built-in strategies, one line each (import strings: no torch until one is used)
register_merger("symfuse.merge.simple:SimpleMerger", name="simple")
register_merger("symfuse.merge.simple:FisherMerger", name="fisher")
register_merger("symfuse.merge.regmean:RegMeanMerger", name="regmean")
register_merger("symfuse.merge.regmean_plusplus_merger:RegMeanPlusPlusMerger", name="regmean++")
register_merger("symfuse.merge.task_vectors:TaskArithmeticMerger", name="task-arithmetic")
register_merger("symfuse.merge.task_vectors:TiesMerger", name="ties")
register_merger("symfuse.merge.task_vectors:DareMerger", name="dare")
register_merger("symfuse.merge.breadcrumbs:BreadcrumbsMerger", name="breadcrumbs")
register_merger("symfuse.merge.breadcrumbs:BreadcrumbsTiesMerger", name="breadcrumbs-ties")
register_merger("symfuse.merge.della:DellaMerger", name="della")
register_merger("symfuse.merge.della:DellaLinearMerger", name="della-linear")
register_merger("symfuse.merge.sce:SceMerger", name="sce")
# mergekit's geometric and selection methods (mergekit 0.1.5's names, ``_`` written ``-``)
register_merger("symfuse.merge.slerp:SlerpMerger", name="slerp")
register_merger("symfuse.merge.nuslerp:NuSlerpMerger", name="nuslerp")
register_merger("symfuse.merge.multislerp:MultiSlerpMerger", name="multislerp")
register_merger("symfuse.merge.karcher:KarcherMerger", name="karcher")
register_merger("symfuse.merge.model_stock:ModelStockMerger", name="model-stock")
register_merger("symfuse.merge.nearswap:NearSwapMerger", name="nearswap")
register_merger("symfuse.merge.arcee_fusion:ArceeFusionMerger", name="arcee-fusion")
register_merger("symfuse.merge.passthrough:PassthroughMerger", name="passthrough")
