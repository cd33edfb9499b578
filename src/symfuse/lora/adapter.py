"""PEFT LoRA adapter folders: read, check and write them without PEFT.

A folder holds ``adapter_config.json`` (``peft_type: LORA``, ``r``, ``lora_alpha``, ``use_rslora``, ``use_dora``,
``rank_pattern`` / ``alpha_pattern``, ``target_modules``, ``base_model_name_or_path``, ...) and
``adapter_model.safetensors`` with, per adapted linear module ``<key>`` (its name in the base model, e.g.
``model.layers.0.self_attn.q_proj``)::

    base_model.model.<key>.lora_A.weight            (r, in)
    base_model.model.<key>.lora_B.weight            (out, r)
    base_model.model.<key>.lora_magnitude_vector    (out,)       DoRA only

The module's update is ``delta = scale * B @ A`` with ``scale = alpha / r`` (``alpha / sqrt(r)`` with rslora), ``r``
the module's rank (its tensors' shape) and ``alpha`` from ``alpha_pattern`` (PEFT's key matching) else
``lora_alpha``. A DoRA module's weight is ``m * (W + delta) / ||W + delta||`` with the norm of each output row
(PEFT's ``get_weight_norm``: ``torch.linalg.norm(W + delta, dim=1)`` for ``nn.Linear``).

PEFT also saves the base layer of an adapted ``lm_head`` / embedding (``<key>.base_layer.weight``, loaded over the
base's weight): kept as :attr:`LoraAdapter.saved_base`, for the merge to check that it is the base's weight.

What this reader cannot represent exactly is refused in one line naming the file or key: another PEFT type,
``lora_bias``, convolution LoRA, DoRA embeddings and other tensors that are not a LoRA pair (but the modules of
``modules_to_save``, kept as :attr:`LoraAdapter.saved_modules`); so is
a module whose rank is not the config's ``r`` (or its ``rank_pattern`` entry), which PEFT could not load.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from symfuse.errors import CheckpointError
from symfuse.io import read_header, save_safetensors

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
_A, _B, _M = ".lora_A.weight", ".lora_B.weight", ".lora_magnitude_vector"
_EMBEDDING = {".lora_embedding_A": _A, ".lora_embedding_B": _B}  # an nn.Embedding's factors, as A and B
_SAVED = (".base_layer.weight", ".base_layer.bias")  # PEFT's copy of an adapted lm_head / embedding's base layer
# adapter_config.json keys that change what the stored tensors mean in ways this reader does not model
_REFUSED = {
    "lora_bias": "lora_B carries a bias (lora_bias)",
    "trainable_token_indices": "it stores trained token rows (trainable_token_indices)",
    "target_parameters": "it adapts nn.Parameters (target_parameters)",
    "layer_replication": "it replicates layers (layer_replication)",
    "use_qalora": "it is a QA-LoRA adapter (use_qalora)",
    "alora_invocation_tokens": "it is an activated LoRA (alora_invocation_tokens)",
    "use_bdlora": "it is a block-diagonal LoRA (use_bdlora)",
}
# init_lora_weights values whose adapter applies to a residual of the base that PEFT rebuilds on load
# PEFT's TaskType values (peft.utils.peft_types): PeftModel.from_pretrained refuses any other task_type
TASK_TYPES = ("SEQ_CLS", "SEQ_2_SEQ_LM", "CAUSAL_LM", "TOKEN_CLS", "QUESTION_ANS", "FEATURE_EXTRACTION")
_FLAGS = ("use_dora", "use_rslora", "fan_in_fan_out")  # JSON booleans (PEFT takes the string "false" as true)
_RESIDUAL_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")


@dataclass(frozen=True)
class LoraModule:
    """One adapted linear module of an adapter.

    Attributes:
        key: The module's name in the base model (``model.layers.0.self_attn.q_proj``).
        A: ``lora_A`` ``(r, in)`` as stored.
        B: ``lora_B`` ``(out, r)`` as stored.
        scale: ``alpha / r`` (``alpha / sqrt(r)`` with rslora).
        magnitude: DoRA's ``(out,)`` magnitude, else None.
        embedding: An ``nn.Embedding``'s LoRA (``lora_embedding_A`` ``(r, vocab)``, ``lora_embedding_B``
            ``(dim, r)``): ``B A`` is the transpose of the stored ``(vocab, dim)`` weight's update, as a ``Conv1D``'s.
    """

    key: str
    A: torch.Tensor
    B: torch.Tensor
    scale: float
    magnitude: torch.Tensor | None = None
    embedding: bool = False

    @property
    def rank(self) -> int:
        """The module's rank ``r``."""
        return int(self.A.shape[0])

    def delta(self) -> torch.Tensor:
        """``scale * B @ A`` in float64, ``(out, in)``."""
        return self.scale * (self.B.to(torch.float64) @ self.A.to(torch.float64))


@dataclass(frozen=True)
class LoraAdapter:
    """A PEFT LoRA adapter folder, read and checked.

    Attributes:
        path: The folder.
        config: ``adapter_config.json`` as read.
        modules: ``{key: LoraModule}`` in storage order.
        dtype: The stored dtype of its LoRA tensors.
        saved_base: ``{base tensor name: tensor}``: copies of base weights the adapter carries (PEFT saves an
            adapted ``lm_head`` / embedding's base layer; loading the adapter puts it over the base's weight).
        saved_modules: ``{base tensor name: tensor}``: the modules it trained whole (``modules_to_save``: a
            classifier), loaded over the base's (see :mod:`symfuse.lora.heads`).
    """

    path: Path
    config: Mapping[str, Any]
    modules: Mapping[str, LoraModule]
    dtype: torch.dtype
    saved_base: Mapping[str, torch.Tensor] = field(default_factory=dict)
    saved_modules: Mapping[str, torch.Tensor] = field(default_factory=dict)

    @property
    def dora(self) -> bool:
        """Whether it is a DoRA adapter."""
        return bool(self.config.get("use_dora"))

    @property
    def base(self) -> str | None:
        """``base_model_name_or_path``."""
        return self.config.get("base_model_name_or_path")


def is_adapter(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` is a PEFT adapter folder (holds ``adapter_config.json``)."""
    return (Path(folder) / CONFIG).is_file()


def _pattern_key(patterns: Mapping[str, Any], key: str) -> str | None:
    """PEFT's ``get_pattern_key``: the first pattern that matches the end of ``key`` after a dot, else None."""
    return next((p for p in patterns if re.match(rf"(.*\.)?({p})$", key)), None)


def pattern_value(patterns: Mapping[str, Any], key: str, default: Any) -> Any:
    """The value of the first pattern (PEFT's ``get_pattern_key`` lookup) matching ``key``, else ``default``."""
    p = _pattern_key(patterns, key)
    return default if p is None else patterns[p]


def _read_config(folder: Path) -> dict[str, Any]:
    file = folder / CONFIG
    if not file.is_file():
        raise CheckpointError(f"{folder}: no {CONFIG} — not a PEFT adapter folder; give a folder saved by PEFT")
    try:
        cfg = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{file}: unreadable ({exc}) — re-save the adapter with PEFT") from exc
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{file}: holds a JSON {_json_kind(cfg)}, not an object of settings — "
                              "give the adapter_config.json PEFT saved")  # fmt: skip
    if cfg.get("peft_type") != "LORA":
        raise CheckpointError(f"{file}: peft_type is {cfg.get('peft_type')!r}, not LORA — only LoRA / DoRA adapters "
                              "merge here")  # fmt: skip
    for key, what in _REFUSED.items():
        if cfg.get(key):
            raise CheckpointError(f"{file}: {key} is set: {what} — not supported; merge adapters without it")
    init = cfg.get("init_lora_weights")
    if isinstance(init, str) and init.startswith(_RESIDUAL_INITS):
        raise CheckpointError(
            f"{file}: init_lora_weights is {init!r}: the adapter applies to the residual base PEFT builds from the "
            "base on load, not to the base — convert it to a plain LoRA first (PEFT's save_pretrained with "
            "path_initial_model_for_weight_conversion) and merge that"
        )
    for key in _FLAGS:
        if cfg.get(key) is not None and not isinstance(cfg[key], bool):
            raise CheckpointError(f"{file}: {key} is {cfg[key]!r}, not true or false — write it as a JSON boolean")
    if cfg.get("task_type") is not None and cfg["task_type"] not in TASK_TYPES:
        raise CheckpointError(f"{file}: task_type {cfg['task_type']!r} is not one PEFT loads — give one of "
                              f"{', '.join(TASK_TYPES)} (or null)")  # fmt: skip
    for key in ("r", "lora_alpha"):
        if not _positive(cfg.get(key), whole=key == "r"):
            raise CheckpointError(f"{file}: {key} is {cfg.get(key)!r} — it must be a positive {_NUMBER[key == 'r']}")
    saves = cfg.get("modules_to_save")
    if saves is not None and not _strings(saves):
        raise CheckpointError(f"{file}: modules_to_save is {saves!r} — it must be a list of module names, as PEFT "
                              "writes it")  # fmt: skip
    targets = cfg.get("target_modules")
    if targets is not None and not (isinstance(targets, str) or _strings(targets)):  # copied into the merged config
        raise CheckpointError(f"{file}: target_modules is {targets!r} — it must be a module-name pattern or a list "
                              "of module names, as PEFT writes it")  # fmt: skip
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(cfg.get(key) or {}, dict):
            raise CheckpointError(f"{file}: {key} is {cfg[key]!r} — it must map module names to numbers")
        for name, value in (cfg.get(key) or {}).items():
            _check_pattern(file, key, name, value)
    return cfg


_NUMBER = ("finite number", "whole number")


def _json_kind(value: Any) -> str:
    """The JSON name of a parsed value's kind (``[]`` is an array, ``"x"`` a string)."""
    kinds = {list: "array", str: "string", bool: "boolean", int: "number", float: "number", type(None): "null"}
    return kinds.get(type(value), type(value).__name__)


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _positive(value: Any, whole: bool) -> bool:
    """A positive finite number (a whole one if ``whole``); a JSON boolean is not one."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        return False
    return not whole or float(value).is_integer()


def _check_pattern(file: Path, key: str, name: str, value: Any) -> None:
    """A ``rank_pattern`` / ``alpha_pattern`` entry: a regular expression PEFT can match, a positive number."""
    try:
        re.compile(name)
    except re.error as exc:
        raise CheckpointError(f"{file}: {key} key {name!r} is not a regular expression ({exc}) — fix it") from None
    if not _positive(value, whole=key == "rank_pattern"):
        raise CheckpointError(f"{file}: {key}[{name!r}] is {value!r} — it must be a positive "
                              f"{_NUMBER[key == 'rank_pattern']}")  # fmt: skip


def _check_rank(cfg: Mapping[str, Any], key: str, rank: int, file: Path) -> None:
    """PEFT sizes a module's factors from ``r`` (or its ``rank_pattern`` entry) and cannot load another rank."""
    pattern = _pattern_key(cfg.get("rank_pattern") or {}, key)
    want = cfg["r"] if pattern is None else cfg["rank_pattern"][pattern]
    if rank != want:
        field, via = ("r", "") if pattern is None else ("rank_pattern", f" (rank_pattern {pattern!r})")
        raise CheckpointError(
            f"{file.parent}: {PREFIX}{key}{_A} has rank {rank} but {CONFIG} says r = {want}{via} — fix {field} in "
            f"{CONFIG} or re-save the adapter with PEFT"
        )


def _module_scale(cfg: Mapping[str, Any], key: str, rank: int) -> float:
    alpha = float(pattern_value(cfg.get("alpha_pattern") or {}, key, cfg["lora_alpha"]))
    return alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank


def _split(name: str, file: Path) -> tuple[str, str]:
    """``(module key, suffix)`` of a stored tensor name; anything but a LoRA pair / magnitude is refused."""
    for suffix in (_A, _B, _M, *_SAVED, *_EMBEDDING):
        if name.endswith(suffix) and name.startswith(PREFIX):
            return name[len(PREFIX) : -len(suffix)], suffix
    raise CheckpointError(
        f"{file}: {name} is not a LoRA A / B / magnitude tensor: the adapter holds more than LoRA / DoRA factors (a "
        "LoRA variant such as KaSA or VeRA, or a saved copy of a base weight) that symfuse does not merge, and a "
        "variant's update merged without its own tensors is wrong — merge plain LoRA or DoRA adapters"
    )


def read_adapter(folder: str | os.PathLike) -> LoraAdapter:
    """Read and check a PEFT LoRA adapter folder.

    Raises:
        CheckpointError: one line naming the file or tensor: not an adapter, an unsupported feature, a missing
            or misshapen tensor, a rank other than the config's ``r`` / ``rank_pattern`` (PEFT could not load it).
    """
    folder = Path(folder)
    cfg = _read_config(folder)
    file = folder / WEIGHTS
    if not file.is_file():
        raise CheckpointError(f"{folder}: no {WEIGHTS} — save the adapter with safetensors (PEFT's default)")
    parts: dict[str, dict[str, torch.Tensor]] = {}
    saved: dict[str, torch.Tensor] = {}
    whole: dict[str, torch.Tensor] = {}
    embeddings: set[str] = set()
    read_header(file)  # a cut or garbage file is one line naming it, not safetensors' own error
    with safe_open(str(file), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            if _saved_module(cfg, name):
                whole[name[len(PREFIX) :]] = _float(f.get_tensor(name), name, file)
                continue
            key, suffix = _split(name, file)
            if suffix in _SAVED:
                saved[key + suffix.removeprefix(".base_layer")] = f.get_tensor(name)
            else:
                parts.setdefault(key, {})[_EMBEDDING.get(suffix, suffix)] = f.get_tensor(name)
                embeddings.update([key] if suffix in _EMBEDDING else [])
    if not parts:
        raise CheckpointError(f"{file}: holds no LoRA tensors — re-save the adapter")
    modules = {k: _module(cfg, k, p, file, k in embeddings) for k, p in parts.items()}
    _check_layers(cfg, modules, folder / CONFIG)
    dtypes = {m.A.dtype for m in modules.values()} | {m.B.dtype for m in modules.values()}
    stray = next((n for n in saved if n.rsplit(".", 1)[0] not in modules), None)
    if stray is not None:
        raise CheckpointError(f"{file}: {PREFIX}{stray.rsplit('.', 1)[0]}.base_layer.* is a base layer copy of a "
                              "module the adapter does not adapt — re-save the adapter with PEFT")  # fmt: skip
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    return LoraAdapter(folder, cfg, modules, dtype, saved, whole)


def _saved_module(cfg: Mapping[str, Any], name: str) -> bool:
    """Whether stored tensor ``name`` belongs to a module of ``modules_to_save`` (PEFT: a module path ending so)."""
    if not name.startswith(PREFIX) or name.endswith((_A, _B, _M, *_SAVED)):
        return False
    parts = name[len(PREFIX) :].split(".")
    paths = {".".join(parts[:j]) for j in range(1, len(parts))}
    return any(p.endswith(m) for p in paths for m in cfg.get("modules_to_save") or ())  # "pre_classifier" too


def _float(t: torch.Tensor, name: str, file: Path) -> torch.Tensor:
    """A saved module's tensor, checked: float and finite."""
    if not t.is_floating_point() or not bool(torch.isfinite(t).all()):
        raise CheckpointError(f"{file}: {name} (modules_to_save) is {t.dtype} or holds NaN / inf — re-train the head")
    return t


_LAYER_LISTS = ["layers", "h", "block", "blocks", "layer"]  # PEFT's COMMON_LAYERS_PATTERN


def _check_layers(cfg: Mapping[str, Any], keys: Iterable[str], file: Path) -> None:
    """Every module of the adapter lies in a layer its ``layers_to_transform`` names (else PEFT cannot load it)."""
    wanted = cfg.get("layers_to_transform")
    if wanted is None:
        return
    layers = [wanted] if isinstance(wanted, int) else wanted
    if not isinstance(layers, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
        raise CheckpointError(f"{file}: layers_to_transform is {wanted!r} — it must be a layer index or a list of "
                              "them, as PEFT writes it")  # fmt: skip
    names = cfg.get("layers_pattern") or _LAYER_LISTS
    names = [names] if isinstance(names, str) else names
    if not _strings(names):
        raise CheckpointError(f"{file}: layers_pattern is {names!r} — it must name the model's layer list")
    found = re.compile(rf"(?:^|\.)(?:{'|'.join(map(re.escape, names))})\.(\d+)\.")
    for key in keys:
        if (m := found.search(key)) and int(m.group(1)) not in layers:
            raise CheckpointError(
                f"{file}: layers_to_transform is {wanted!r}, but the adapter holds {key} (layer {m.group(1)}) — PEFT "
                "cannot load it; list every adapted layer there (or re-save the adapter with PEFT)"
            )


def _module(cfg: Mapping[str, Any], key: str, p: dict[str, torch.Tensor], file: Path, embedding: bool) -> LoraModule:
    """One module's checked tensors."""
    a, b, m = p.get(_A), p.get(_B), p.get(_M)
    if embedding and m is not None:
        raise CheckpointError(f"{file}: {key} is a DoRA embedding — not supported; merge DoRA adapters of linear "
                              "modules, or plain LoRA embeddings")  # fmt: skip
    if a is None or b is None:
        missing = _A if a is None else _B
        raise CheckpointError(f"{file}: {PREFIX}{key}{missing} is missing — re-save the adapter")
    if a.dim() != 2 or b.dim() != 2:
        raise CheckpointError(
            f"{file}: {PREFIX}{key}{_A} has {a.dim()} dims (a convolution LoRA?) — only linear modules merge here"
        )
    if b.shape[1] != a.shape[0]:
        raise CheckpointError(f"{file}: {key}: lora_B {tuple(b.shape)} and lora_A {tuple(a.shape)} differ in rank")
    _check_rank(cfg, key, int(a.shape[0]), file)
    if bool(cfg.get("use_dora")) != (m is not None):
        what = "has no" if m is None else "has a"
        raise CheckpointError(f"{file}: {key} {what} lora_magnitude_vector but use_dora is {cfg.get('use_dora')}")
    if m is not None and tuple(m.shape) != (b.shape[0],):
        raise CheckpointError(f"{file}: {key}: magnitude {tuple(m.shape)} does not match lora_B {tuple(b.shape)}")
    for name, t in (("lora_A", a), ("lora_B", b), ("magnitude", m)):
        if t is not None and not t.is_floating_point():
            raise CheckpointError(f"{file}: {key}.{name} is stored as {t.dtype} — LoRA factors are float tensors; "
                                  "re-save the adapter (quantised adapters do not merge here)")  # fmt: skip
        if t is not None and not bool(torch.isfinite(t).all()):
            raise CheckpointError(f"{file}: {key}.{name} holds NaN / inf — the adapter is broken; re-train it")
    return LoraModule(key, a, b, _module_scale(cfg, key, int(a.shape[0])), m, embedding)


def write_adapter(
    folder: Path,
    config: Mapping[str, Any],
    factors: Mapping[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
    dtype: torch.dtype,
    modules: Mapping[str, torch.Tensor] | None = None,
    embeddings: Iterable[str] = (),
) -> None:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` into ``folder`` (an empty temporary folder).

    Args:
        folder: Where to write (the caller renames it into place).
        config: The adapter config to write.
        factors: ``{key: (B, A, magnitude or None)}``.
        dtype: The stored dtype (of the factors).
        modules: ``{base tensor name: tensor}`` of modules saved whole (``modules_to_save``), stored as given.
        embeddings: The keys of ``factors`` that are embeddings (stored as ``lora_embedding_A`` / ``_B``).
    """
    embeddings = set(embeddings)
    tensors: dict[str, torch.Tensor] = {f"{PREFIX}{n}": t.contiguous() for n, t in (modules or {}).items()}
    for key, (b, a, m) in factors.items():
        a_name, b_name = (".lora_embedding_A", ".lora_embedding_B") if key in embeddings else (_A, _B)
        tensors[f"{PREFIX}{key}{a_name}"] = a.to(dtype).contiguous()
        tensors[f"{PREFIX}{key}{b_name}"] = b.to(dtype).contiguous()
        if m is not None:
            tensors[f"{PREFIX}{key}{_M}"] = m.to(dtype).contiguous()
    save_safetensors(tensors, folder / WEIGHTS, {"format": "pt"})  # atomic, readable by all as every output
    (folder / CONFIG).write_text(json.dumps(dict(config), indent=2, sort_keys=True))
