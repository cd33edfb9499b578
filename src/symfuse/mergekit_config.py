"""mergekit's merge YAML, read as it is: translated to the fields of a symfuse merge file (:mod:`symfuse.merge_config`).

A document with ``merge_method`` is mergekit's (schema of mergekit 0.1.5, ``mergekit/config.py``)::

    models:
      - model: ft/isear
        parameters: {density: 0.5, weight: 1.0}
      - model: ft/meld
        parameters: {density: 0.5, weight: 0.5}
    merge_method: ties
    base_model: minilm
    parameters: {normalize: true, int8_mask: true}
    dtype: float16

What it says is merged, the same thing mergekit merges, or refused in one line naming the key:

* ``merge_method``: ``linear`` -> ``simple``, ``task_arithmetic`` -> ``task-arithmetic``, ``ties`` -> ``ties``,
  ``dare_linear`` / ``dare_ties`` -> ``dare`` (``combine: task-arithmetic`` / ``ties``); any other name with ``_``
  written ``-``, when symfuse has that strategy (its parameters then keep mergekit's names and values).
* ``base_model`` -> ``base``; a model equal to it is dropped from ``models`` by the task-vector methods (mergekit
  skips it too); the other methods merge it first.
* ``models[i].parameters.weight`` -> ``weights`` (absent everywhere: uniform; >= 0). Any other per-model parameter
  must be equal across models (symfuse applies one value to every model); a value in ``parameters`` applies to
  every model that does not give its own, as in mergekit.
* The parameters of the five methods above become symfuse's: ``density`` -> ``density`` (ties; mergekit's default
  1.0 is written out, symfuse's is 0.2) or ``drop = 1 - density`` (dare); ``lambda`` and the weights -> ``lam``
  (task arithmetic sums ``lambda * w_i * tau_i``, symfuse ``lam * K * w_i / sum(w) * tau_i``; with
  ``normalize: true`` the sum is divided by ``sum(w)``); ``int8_mask`` (mask storage) is read and has no effect;
  ``normalize`` / ``rescale`` are refused where symfuse computes otherwise (``ties`` and ``dare_ties`` need
  ``normalize: true``: symfuse takes the weighted mean of the agreeing entries; ``dare`` rescales the kept entries
  by ``1 / density``, mergekit's ``rescale: true`` matches their L1 norm: the same in expectation).
* ``out_dtype`` (else ``dtype``) -> ``out_dtype``: the merged tensors are written in it. symfuse computes in float32
  (mergekit in ``dtype``), so a float16 / bfloat16 merge may differ from mergekit's in its last bits.
* ``tokenizer_source``: absent, ``base`` or the first model (symfuse writes the first model's tokenizer).
* ``slices``: one slice whose sources each cover their model's whole layer stack reads as ``models``.

Refused, each in one line: ``slices`` / ``layer_range`` that select layers, ``modules``, per-layer values
(gradients, ``filter:`` lists) where the strategy reads one number, unequal per-model parameters, negative weights,
``tokenizer_source: union`` or another model, ``tokenizer`` / ``chat_template`` settings, ``model+lora`` adapters
and methods symfuse does not have. This module imports only pydantic (through the registry) and the standard
library: a bad file fails before torch is imported.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from symfuse.errors import UsageError
from symfuse.merge.registry import MERGERS

KEYS = (
    "merge_method",
    "base_model",
    "models",
    "slices",
    "parameters",
    "dtype",
    "out_dtype",
    "tokenizer_source",
    "tokenizer",
    "chat_template",
    "modules",
)


@dataclass(frozen=True)
class Method:
    """How one of mergekit's methods reads as a symfuse strategy (mergekit 0.1.5 ``merge_methods/registry.py``)."""

    strategy: str
    model_params: frozenset[str]  # per-model ("tensor") parameters besides weight
    global_params: frozenset[str]
    normalize: bool  # mergekit's default
    rescale: bool = False  # mergekit's default
    combine: str | None = None  # dare's combine


_GTA_GLOBAL = frozenset({"lambda", "normalize", "rescale", "int8_mask"})
METHODS = {
    "linear": Method("simple", frozenset(), frozenset({"normalize"}), normalize=True),
    "task_arithmetic": Method("task-arithmetic", frozenset({"density"}), _GTA_GLOBAL, normalize=False),
    "ties": Method("ties", frozenset({"density"}), _GTA_GLOBAL, normalize=True),
    "dare_linear": Method("dare", frozenset({"density"}), _GTA_GLOBAL, False, True, "task-arithmetic"),
    "dare_ties": Method("dare", frozenset({"density"}), _GTA_GLOBAL, False, True, "ties"),
}
# mergekit's other task-vector methods (symfuse names them alike, with mergekit's parameters): the base model is
# skipped among the models, and without normalize the weights' sum scales the result (mergekit's normalize default)
TASK_VECTOR_NORMALIZE = {"breadcrumbs": False, "breadcrumbs_ties": False, "della": True, "della_linear": False}
TASK_VECTOR_METHODS = {*METHODS.keys() - {"linear"}, *TASK_VECTOR_NORMALIZE, "sce"}


@dataclass
class Translation:
    """A mergekit document as a symfuse merge file: its fields, where each parameter came from, what to tell."""

    data: dict[str, Any]  # MergeFile fields
    labels: dict[str, str] = field(default_factory=dict)  # symfuse parameter -> the mergekit key it came from
    notes: list[str] = field(default_factory=list)  # info lines (what is read but not applied)


def is_mergekit(data: Any) -> bool:
    """Whether ``data`` (a parsed YAML document) is a mergekit config (it has ``merge_method``)."""
    return isinstance(data, dict) and "merge_method" in data


def translate(doc: dict[str, Any], path: str | os.PathLike) -> Translation:
    """The symfuse merge file that merges what the mergekit document ``doc`` (read from ``path``) merges.

    Raises:
        UsageError: ``<path>: <key>: <what symfuse cannot do> — <fix>``, one line, for anything listed in the module
            docstring as refused.
    """

    def fail(key: str, what: str) -> UsageError:
        return UsageError(f"{path}: {key}: {what}")

    for key in doc:
        if key not in KEYS:
            raise fail(
                str(key), f"not a mergekit key symfuse reads — remove it or fix its spelling (keys: {', '.join(KEYS)})"
            )
    name = doc["merge_method"]
    if not isinstance(name, str) or not name:
        raise fail("merge_method", f"{name!r} is not a method name — give e.g. ties")
    method = METHODS.get(name)
    strategy = method.strategy if method else name.replace("_", "-")
    if strategy not in MERGERS.names():
        raise fail("merge_method", f"{name} is not in symfuse yet (symfuse has: {', '.join(MERGERS.names())})")
    if doc.get("modules"):
        raise fail("modules", "per-module merges are not supported yet — list the models under models:")
    out_dtype, notes = _out_dtype(doc, fail)
    notes += _extras(doc, fail)
    entries = _entries(doc, fail)
    base = doc.get("base_model")
    if base is not None:
        _model_path(base, "base_model", fail)
    task_vectors = name in TASK_VECTOR_METHODS
    if task_vectors and base is None:
        raise fail("base_model", f"missing — mergekit's {name} works on task vectors: give base_model: PATH")
    if base is not None:
        same = [i for i, (model, _, _) in enumerate(entries) if _same_path(model, base)]
        if task_vectors:  # mergekit takes no task vector of the base itself
            entries = [e for i, e in enumerate(entries) if i not in same]
        elif same:  # merged as one of the models: first, as mergekit's base of two-model methods (slerp)
            entries = [entries[same[0]], *(e for i, e in enumerate(entries) if i != same[0])]
            base = None
        elif name == "linear":
            raise fail("base_model", "linear does not use a base model — remove it, or list it under models:")
        elif name == "slerp":  # mergekit's slerp starts at its base_model (t = 0): one of the two models
            raise fail("base_model", f"{base} is not one of models: — slerp runs from its base_model (t = 0) to the "
                                     "other model; give one of the two models")  # fmt: skip
    if len(entries) < 2 and task_vectors:
        raise fail("models", f"{len(entries)} model(s) to merge besides the base — give two or more")
    known = method.model_params | method.global_params if method else None
    values, labels = _resolve(entries, doc.get("parameters") or {}, fail, method is not None, known)
    weights, w_label = values.pop("weight", None), labels.pop("weight", "models[0].parameters.weight")
    if method:
        params = _native(name, method, values, labels, weights, len(entries), fail)
        labels = {k: labels.get(_MK_NAME.get(k, k), _MK_DEFAULT_KEY.get(k, "merge_method")) for k in params}
    else:
        params = dict(values)
        if name in TASK_VECTOR_NORMALIZE and weights is not None:
            params, labels = _scale_lambda(name, params, labels, weights)
    data = {
        "strategy": strategy,
        "models": [m for m, _, _ in entries],
        "base": base,
        "weights": weights,
        "params": params,
        "out_dtype": out_dtype,
    }
    if weights is not None:
        labels["weights"] = w_label
    return Translation({k: v for k, v in data.items() if v is not None}, labels, notes)


_MK_NAME = {"lam": "lambda", "drop": "density"}  # symfuse parameter -> mergekit's (combine: from merge_method)
_MK_DEFAULT_KEY = {"lam": "parameters.lambda", "drop": "parameters.density", "density": "parameters.density"}


_MK_DTYPES = ("float32", "float16", "bfloat16")  # mergekit's dtype_from_name (also with a "torch." prefix)


def _out_dtype(doc: dict[str, Any], fail: Callable[[str, str], UsageError]) -> tuple[str | None, list[str]]:
    """The dtype mergekit writes (``out_dtype``, else ``dtype``; None: neither) and the info line to log.

    mergekit also computes in ``dtype``; symfuse computes in float32 (float64 where its maths needs it) and writes
    the result in that dtype, so a float16 / bfloat16 merge can differ from mergekit's in its last bits.
    """
    for key in ("dtype", "out_dtype"):
        value = doc.get(key)
        if value is not None and (not isinstance(value, str) or value.removeprefix("torch.") not in _MK_DTYPES):
            raise fail(key, f"{value!r} is not a dtype mergekit merges in — give float32, float16 or bfloat16")
    key = "out_dtype" if doc.get("out_dtype") is not None else "dtype"
    if doc.get(key) is None:
        return None, []
    name = doc[key].removeprefix("torch.")
    return name, [f"{key}: {doc[key]}: merged in float32 or wider, written in {name}"]


def _extras(doc: dict[str, Any], fail: Callable[[str, str], UsageError]) -> list[str]:
    """Check the keys that do not change the merged numbers; return the info lines to log."""
    notes: list[str] = []
    source = doc.get("tokenizer_source")
    first = _first_model(doc)
    if source == "union":
        raise fail(
            "tokenizer_source",
            "union (a merged vocabulary) is not supported yet — remove it (symfuse writes the first model's tokenizer)",
        )
    if source not in (None, "base") and not (first is not None and _same_path(str(source), first)):
        raise fail(
            "tokenizer_source",
            f"{source} — symfuse writes the first model's tokenizer: list {source} first "
            "under models:, or remove tokenizer_source",
        )
    if source == "base" and not doc.get("base_model"):  # mergekit refuses it too
        raise fail("tokenizer_source", "base, and the file names no base_model — name base_model, or remove "
                   "tokenizer_source")  # fmt: skip
    if source == "base":
        notes.append(
            "tokenizer_source: base — symfuse writes the first model's tokenizer (a fine-tune's is its base's)"
        )
    if doc.get("tokenizer"):
        raise fail(
            "tokenizer",
            "tokenizer settings are not supported yet — remove them (symfuse writes the first model's tokenizer)",
        )
    if doc.get("chat_template"):
        raise fail(
            "chat_template",
            "not supported yet — remove it (the first model's tokenizer files, its chat "
            "template included, are written as they are)",
        )
    return notes


def _first_model(doc: dict[str, Any]) -> str | None:
    """The first model's path as written, or None (for the tokenizer_source check)."""
    models = doc.get("models") or []
    first = models[0] if isinstance(models, list) and models else None
    return first.get("model") if isinstance(first, dict) else first if isinstance(first, str) else None


def _entries(doc: dict[str, Any], fail: Callable[[str, str], UsageError]) -> list[tuple[str, dict[str, Any], str]]:
    """``[(model path, its parameters, its key)]`` from ``models`` (or from ``slices`` covering whole models)."""
    models, slices = doc.get("models"), doc.get("slices")
    if models and slices:
        raise fail("slices", "given with models: — give one of them (models: for whole-model merges)")
    where = "models"
    if slices:
        models, where = _whole_model_slices(slices, fail), "slices[0].sources"
    if not isinstance(models, list) or not models:
        raise fail("models", "missing — list the models: [{model: PATH, parameters: {weight: 1.0}}, ...]")
    out = []
    for i, item in enumerate(models):
        key = f"{where}[{i}]"
        if isinstance(item, str):
            item = {"model": item}
        if not isinstance(item, dict) or "model" not in item:
            raise fail(key, f"{item!r} — give {{model: PATH, parameters: {{...}}}}")
        extra = set(item) - {"model", "parameters"} - ({"layer_range"} if slices else set())
        if extra:
            raise fail(
                f"{key}.{sorted(extra)[0]}", "not a key of a mergekit model — remove it (keys: model, parameters)"
            )
        params = item.get("parameters") or {}
        if not isinstance(params, dict):
            raise fail(f"{key}.parameters", f"{params!r} — give a mapping {{name: value}}")
        out.append((_model_path(item["model"], f"{key}.model", fail), params, key))
    return out


def _model_path(value: Any, key: str, fail: Callable[[str, str], UsageError]) -> str:
    """A model reference as a path; ``model+lora`` refused."""
    if not isinstance(value, str) or not value:
        raise fail(key, f"{value!r} — give a checkpoint folder")
    if "+" in value and not Path(value).exists():
        raise fail(
            key,
            f"{value}: LoRA adapters (model+lora) are not supported yet — merge the adapter into its "
            "model first and give that folder",
        )
    return value


def _same_path(a: str, b: str) -> bool:
    return os.path.normpath(a) == os.path.normpath(b)


def _whole_model_slices(slices: Any, fail: Callable[[str, str], UsageError]) -> list[Any]:
    """The sources of a single slice whose every ``layer_range`` is its model's whole layer stack."""
    refuse = "layer slices (passthrough) are not supported yet — merge whole models: list them under models:"
    if not isinstance(slices, list) or len(slices) != 1 or not isinstance(slices[0], dict):
        raise fail("slices", refuse)
    extra = set(slices[0]) - {"sources"}
    if extra:
        raise fail(f"slices[0].{sorted(extra)[0]}", "not supported yet — list the models under models: instead")
    sources = slices[0].get("sources")
    if not isinstance(sources, list):
        raise fail("slices[0].sources", "missing — list the models under models: instead")
    for i, src in enumerate(sources):
        key = f"slices[0].sources[{i}].layer_range"
        model = src.get("model") if isinstance(src, dict) else None
        layers = _layer_count(model) if isinstance(model, str) else None
        if layers is None:
            raise fail(
                key,
                f"cannot tell whether it covers all of {model}'s layers (no readable config.json) — "
                "list the models under models: instead",
            )
        if src.get("layer_range") != [0, layers]:
            raise fail(key, f"{src.get('layer_range')} of {model}'s {layers} layers: {refuse}")
    return sources


def _layer_count(model: str) -> int | None:
    """The layer count in ``model``/config.json, or None."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        if isinstance(config.get(key), int):
            return config[key]
    return None


def _resolve(
    entries: list[tuple[str, dict[str, Any], str]],
    global_params: Any,
    fail: Callable[[str, str], UsageError],
    scalars_only: bool,
    known: set[str] | None = None,
) -> tuple[dict[str, Any], dict[str, str]]:
    """One value per parameter (``weight``: one per model) and the key each came from.

    A model's own value wins over ``parameters``' (mergekit's precedence); per-model values must agree, those of a
    name outside ``known`` (the method's parameters, when known) aside: that name is refused as unknown later.
    """
    if not isinstance(global_params, dict):
        raise fail("parameters", f"{global_params!r} — give a mapping {{name: value}}")
    for key, value in [(f"parameters.{k}", v) for k, v in global_params.items()] + [
        (f"{at}.parameters.{k}", v) for _, p, at in entries for k, v in p.items()
    ]:
        if isinstance(value, dict) or (isinstance(value, list) and (scalars_only or key.endswith(".weight"))):
            raise fail(key, "per-layer values (gradients / filters) are not supported yet — give one number")
        if isinstance(value, list) and not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value):
            bad = next(x for x in value if not isinstance(x, (int, float)) or isinstance(x, bool))
            raise fail(key, f"{bad!r} in a gradient is not a number — give numbers (a gradient) or one number")
    values: dict[str, Any] = dict(global_params)
    labels = {k: f"parameters.{k}" for k in global_params}
    missing = object()
    for name in sorted({k for _, p, _ in entries for k in p} | {"weight"}):
        per_model = [p.get(name, global_params.get(name, missing)) for _, p, _ in entries]
        keys = [f"{at}.parameters.{name}" if name in p else f"parameters.{name}" for _, p, at in entries]
        if name == "weight":
            values.pop("weight", None)
            if all(v is missing for v in per_model):
                continue
            for i, w in enumerate(per_model):
                if w is missing:
                    raise fail(
                        f"{entries[i][2]}.parameters.weight",
                        "missing while other models have a weight — give every model a weight (or none)",
                    )
                if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
                    raise fail(keys[i], f"{w!r} is not a number — give a weight >= 0")
                if w < 0:
                    raise fail(keys[i], f"{w} — symfuse merges weights >= 0 (no task negation yet): give a weight >= 0")
            if sum(per_model) <= 0:
                raise fail(keys[0], f"weights {per_model} sum to 0 — give at least one positive weight")
            values["weight"], labels["weight"] = [float(w) for w in per_model], keys[0]
            continue
        odd = next((i for i, v in enumerate(per_model) if v != per_model[0]), None)
        i = 0 if odd is None or keys[odd].startswith("parameters.") else odd
        if odd is not None and known is not None and name not in known:  # a misspelt name: said by _native
            values[name], labels[name] = per_model[i], keys[i]
            continue
        if odd is not None:
            raise fail(
                keys[i],
                f"{name} differs between models — symfuse applies one {name} to every model: give "
                "them the same value (or one in parameters:)",
            )
        values[name], labels[name] = per_model[0], keys[0]
    return values, labels


def _native(
    name: str,
    method: Method,
    values: dict[str, Any],
    labels: dict[str, str],
    weights: list[float] | None,
    k: int,
    fail: Callable[[str, str], UsageError],
) -> dict[str, Any]:
    """Parameters of a table method (:data:`METHODS`) as symfuse's strategy reads them."""
    for key, value in values.items():
        if key not in method.model_params | method.global_params:
            known = ", ".join(sorted({"weight"} | method.model_params | method.global_params))
            raise fail(labels[key], f"not a parameter of mergekit's {name} — remove it (it reads: {known})")
        if key in method.global_params and not labels[key].startswith("parameters."):
            raise fail(labels[key], f"mergekit reads {key} for the whole merge only — move it to parameters:")
        if key in ("normalize", "rescale", "int8_mask") and not isinstance(value, bool):
            raise fail(labels[key], f"{value!r} — give true or false")
        if key in ("density", "lambda") and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise fail(labels[key], f"{value!r} is not a number — give one number")
    normalize, rescale = values.get("normalize", method.normalize), values.get("rescale", method.rescale)
    total = sum(weights) if weights else float(k)  # no weights: mergekit's weight 1 for each model
    lam, density = float(values.get("lambda", 1.0)), float(values.get("density", 1.0))
    if not (math.isfinite(density) and 0 < density <= 1):  # named as written, not as the drop it becomes
        raise fail(labels["density"], f"{density:g} is outside (0, 1] — give the fraction of entries kept, e.g. 0.5")
    if name == "linear":
        if not normalize and not math.isclose(total, 1.0, rel_tol=1e-12):
            raise fail(
                labels["normalize"],
                f"false with weights summing to {total:g} — symfuse averages with the weights normalised: set "
                "normalize: true, or give weights summing to 1",
            )
        return {}
    if rescale and name == "ties":
        raise fail(labels["rescale"], "true — symfuse's ties does not rescale the trimmed task vectors: remove it")
    if not rescale and method.combine is not None:
        raise fail(labels["rescale"], "false — symfuse's dare always rescales the kept entries (by 1 / density)")
    if not normalize and name in ("ties", "dare_ties"):
        given = "false" if "normalize" in values else "absent (mergekit's default: false)"
        raise fail(
            labels.get("normalize", "parameters.normalize"),
            f"{given} — {name} would then sum the agreeing task vectors; symfuse takes their weighted mean: set "
            "normalize: true",
        )
    if name == "ties":
        return {"density": density, "lam": lam}
    if name == "dare_ties":  # the weighted mean of the agreeing entries, as ties
        return {"drop": 1.0 - density, "combine": "ties", "lam": lam}
    # mergekit adds lambda * sum_i w_i tau_i (divided by sum(w) with normalize), symfuse lam * K * sum_i w_i/sum(w) *
    # tau_i: the same with lam = lambda / K (normalize), lambda * sum(w) / K (not)
    scale = lam / k if normalize else lam * total / k
    if name == "task_arithmetic":
        return {"lam": scale}
    return {"drop": 1.0 - density, "combine": "task-arithmetic", "lam": scale}


def _scale_lambda(
    name: str, params: dict[str, Any], labels: dict[str, str], weights: list[float]
) -> tuple[dict[str, Any], dict[str, str]]:
    """Without normalize, ``lambda`` times ``sum(w) / K``: symfuse's task-vector strategies see weights summing to K."""
    if params.get("normalize", TASK_VECTOR_NORMALIZE[name]) or not isinstance(params.get("lambda", 1.0), (int, float)):
        return params, labels
    factor = sum(weights) / len(weights)
    if factor != 1.0:
        params = {**params, "lambda": float(params.get("lambda", 1.0)) * factor}
        labels = {**labels, "lambda": labels.get("lambda", "parameters.lambda")}
    return params, labels
