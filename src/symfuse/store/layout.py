"""Every artifact key of a run, and the content keys that make stages idempotent.

Keys are relative to the store root, use ``/`` and carry no trailing slash; one key names one artifact (a folder of
files plus ``manifest.json``). Tasks never build keys with f-strings: they call these functions.

```
runs/{run}/models/{dataset}                         fine-tuned (or user-brought) checkpoint
runs/{run}/incoming/{name}                          checkpoints dropped in for `watch_checkpoints`
runs/{run}/stats/{model}/{dataset}/{kind}           {kind}.safetensors of `model` on `dataset`
runs/{run}/transforms/{model}/{module}              one module's transform (module = "L03.attn")
runs/{run}/matched/{model}                          `model` matched onto the anchor
runs/{run}/merged/{strategy}/{plain|matched}        merged checkpoint
runs/{run}/eval/{merged}/{dataset}                  metrics JSON of one model on one dataset
runs/{run}/report                                   report.md, metrics.csv, plots
runs/{run}/published                                what the published merged set and report were made from
```
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol

from pydantic import BaseModel

from symfuse.names import NAME_CHARS, NAME_MAX, is_name

MANIFEST = "manifest.json"
VARIANTS = ("plain", "matched")


class _HasKey(Protocol):
    @property
    def key(self) -> str: ...


def check_segment(value: str, what: str) -> str:
    """Validate one path segment of a key (a run id, dataset, model, kind, strategy or module name).

    Args:
        value: The segment.
        what: What it names (for the message).

    Returns:
        The segment, unchanged.

    Raises:
        ValueError: if it is empty or longer than :data:`~symfuse.names.NAME_MAX`, holds ``/`` or characters outside
            ``[A-Za-z0-9._@+=-]``, or starts with one of ``._@+=-``.
    """
    if not is_name(value):
        raise ValueError(
            f"{what} {value!r} cannot be part of an artifact key: use 1-{NAME_MAX} {NAME_CHARS} "
            "(no '/', not starting with a symbol)"
        )
    return value


def runs_prefix() -> str:
    """``runs``: its folders are the store's runs (list them with ``ArtifactStore.folders``)."""
    return "runs"


def run_prefix(run: str) -> str:
    """``runs/{run}``: the prefix holding every artifact of a run."""
    return f"runs/{check_segment(run, 'run id')}"


def model_key(run: str, dataset: str) -> str:
    """``runs/{run}/models/{dataset}``: the checkpoint fine-tuned on (or brought for) ``dataset``."""
    return f"{run_prefix(run)}/models/{check_segment(dataset, 'dataset')}"


def models_prefix(run: str) -> str:
    """``runs/{run}/models``: list it to find every fine-tuned model of a run."""
    return f"{run_prefix(run)}/models"


def incoming_prefix(run: str) -> str:
    """``runs/{run}/incoming``: where new checkpoints are dropped for ``watch_checkpoints`` to find."""
    return f"{run_prefix(run)}/incoming"


def incoming_key(run: str, name: str) -> str:
    """``runs/{run}/incoming/{name}``: one dropped-in checkpoint."""
    return f"{incoming_prefix(run)}/{check_segment(name, 'checkpoint name')}"


def stats_key(run: str, model: str, dataset: str, kind: str) -> str:
    """``runs/{run}/stats/{model}/{dataset}/{kind}``: statistics of ``kind`` (gram, fisher) of a model on a dataset."""
    return (
        f"{run_prefix(run)}/stats/{check_segment(model, 'model')}/"
        f"{check_segment(dataset, 'dataset')}/{check_segment(kind, 'stats kind')}"
    )


def transform_key(run: str, model: str, module: str | _HasKey) -> str:
    """``runs/{run}/transforms/{model}/{module}``: the transform mapping one module of ``model`` onto the anchor.

    Args:
        run: Run id.
        model: The (source) model's name.
        module: A module key such as ``"L03.attn"`` or a ``ModuleRef`` (its ``.key`` is used).
    """
    name = module if isinstance(module, str) else module.key
    return f"{run_prefix(run)}/transforms/{check_segment(model, 'model')}/{check_segment(name, 'module')}"


def matched_key(run: str, model: str) -> str:
    """``runs/{run}/matched/{model}``: ``model`` with its transforms applied (save_pretrained folder)."""
    return f"{run_prefix(run)}/matched/{check_segment(model, 'model')}"


def merged_key(run: str, strategy: str, variant: Literal["plain", "matched"]) -> str:
    """``runs/{run}/merged/{strategy}/{variant}``: a merged checkpoint.

    Raises:
        ValueError: if ``variant`` is not ``plain`` or ``matched``.
    """
    if variant not in VARIANTS:
        raise ValueError(f"merge variant {variant!r}: expected one of {VARIANTS}")
    return f"{run_prefix(run)}/merged/{check_segment(strategy, 'strategy')}/{variant}"


def selected_key(run: str, strategy: str, models: Sequence[str]) -> str:
    """``runs/{run}/selected/{strategy}/{m1+m2+...}``: a merge of a subset of the models tried by greedy selection."""
    if not models:
        raise ValueError("a selected merge needs at least one model")
    names = "+".join(check_segment(m, "model") for m in models)
    return f"{run_prefix(run)}/selected/{check_segment(strategy, 'strategy')}/{names}"


def selection_key(run: str, strategy: str) -> str:
    """``runs/{run}/selection/{strategy}``: greedy selection's record (chosen subset, path of tries)."""
    return f"{run_prefix(run)}/selection/{check_segment(strategy, 'strategy')}"


def merged_prefix(run: str) -> str:
    """``runs/{run}/merged``: list it to find every merged model of a run."""
    return f"{run_prefix(run)}/merged"


def matched_prefix(run: str) -> str:
    """``runs/{run}/matched``: list it to find every matched model of a run."""
    return f"{run_prefix(run)}/matched"


def eval_prefix(run: str) -> str:
    """``runs/{run}/eval``: list it to collect every evaluation of a run."""
    return f"{run_prefix(run)}/eval"


def merged_name(strategy: str, variant: Literal["plain", "matched"]) -> str:
    """``{strategy}-{variant}``: the name of a merged model in eval keys and reports."""
    if variant not in VARIANTS:
        raise ValueError(f"merge variant {variant!r}: expected one of {VARIANTS}")
    return f"{check_segment(strategy, 'strategy')}-{variant}"


def eval_key(run: str, model: str, dataset: str) -> str:
    """``runs/{run}/eval/{model}/{dataset}``: metrics of a model (merged name or dataset model) on a dataset."""
    return f"{run_prefix(run)}/eval/{check_segment(model, 'model')}/{check_segment(dataset, 'dataset')}"


def inspect_key(run: str) -> str:
    """``runs/{run}/inspect``: ``symfuse inspect``'s figures and verdict on the run's models (one JSON record)."""
    return f"{run_prefix(run)}/inspect"


def paths_key(run: str, model: str) -> str:
    """``runs/{run}/paths/{model}``: the loss along the straight path from the anchor to a model, plain and aligned."""
    return f"{run_prefix(run)}/paths/{model}"


def report_key(run: str) -> str:
    """``runs/{run}/report``: report.md, metrics.csv and plots."""
    return f"{run_prefix(run)}/report"


def published_key(run: str) -> str:
    """``runs/{run}/published``: the record of the last published merge (models' digests, merged and report versions).

    Written last, after every merged model and the report of a run were published together: a model counts as
    merged only once it is listed there.
    """
    return f"{run_prefix(run)}/published"


def manifest_digest(manifest: Mapping[str, Any]) -> str:
    """sha256 of an artifact's content as its manifest records it (files and their sha256, nothing else).

    Two artifacts with the same bytes have the same digest, whoever wrote them and when.
    """
    content = {"sha256": dict(sorted(manifest["sha256"].items()))}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def content_key(config: BaseModel | Mapping[str, Any] | None, inputs: Mapping[str, Mapping[str, Any] | str]) -> str:
    """Short hash of a stage's config and its inputs' content: equal keys mean the stage's result can be reused.

    Args:
        config: The stage's settings (pydantic model or JSON-able mapping); only what changes the result.
        inputs: Name -> input artifact, each either its manifest (hashed by content, see :func:`manifest_digest`)
            or a string (a URI or version tag, hashed as written; for inputs that are not store artifacts).

    Returns:
        16 hex characters.
    """
    if isinstance(config, BaseModel):
        cfg: Any = config.model_dump(mode="json")
    else:
        cfg = dict(config or {})
    ins = {name: (value if isinstance(value, str) else manifest_digest(value)) for name, value in inputs.items()}
    blob = json.dumps({"config": cfg, "inputs": ins}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
