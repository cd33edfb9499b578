"""Family registry: every ``families/*.yaml`` becomes an :class:`ArchSpec`, found by ``model_type``."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from symfuse import yaml_io
from symfuse.arch.spec import ArchSpec, AttentionSpec, FFNSpec, HeadSpec, NormSpec, StackSpec
from symfuse.errors import UnsupportedArchitecture

_FAMILIES = Path(__file__).parent / "families"


def _parse(path: Path) -> ArchSpec:
    try:
        raw = yaml_io.load(path.read_text(), fast=True)  # libyaml where there is one; refuses a key given twice
    except yaml_io.DuplicateKeyError as exc:
        raise ValueError(f"{path.name}: {exc}") from exc
    known = {
        "family",
        "model_types",
        "base_prefix",
        "layer",
        "attention",
        "ffn",
        "norm",
        "embeddings",
        "embedding_norm",
        "embedding_projection",
        "final_norm",
        "rope",
        "conv1d",
        "relative_embeddings",
        "relative_norm",
        "heads",
        "checkpoint_layout",
        "extra",
        "inputs",
        "n_layers_key",
        "require",
        "stacks",
        "config_keys",
        "output",
        "config_variants",
        "forward",
        "residual_group",
    }
    unknown = set(raw) - known
    if unknown:  # a spec field nobody reads is a bug, not a comment
        raise ValueError(f"{path.name}: unknown keys {sorted(unknown)}")
    return _build(raw)


_STACK_KEYS = {
    "name",
    "layer",
    "norm",
    "attention",
    "ffn",
    "n_layers_key",
    "config",
    "stream",
    "embeddings",
    "embedding_norm",
    "final_norm",
    "heads",
}


def _norm(raw: dict[str, Any]) -> NormSpec:
    return NormSpec(**{**raw, "extra": tuple(raw.get("extra", ()))})


def _stack(raw: dict[str, Any]) -> StackSpec:
    unknown = set(raw) - _STACK_KEYS
    if unknown:
        raise ValueError(f"stack {raw.get('name')!r}: unknown keys {sorted(unknown)}")
    return StackSpec(
        name=raw["name"],
        layer=raw["layer"],
        norm=_norm(raw["norm"]),
        attention=AttentionSpec(**raw["attention"]) if raw.get("attention") else None,
        ffn=FFNSpec(**raw["ffn"]) if raw.get("ffn") else None,
        n_layers_key=raw.get("n_layers_key", "num_hidden_layers"),
        config=raw.get("config"),
        stream=raw.get("stream", ""),
        embeddings=tuple(raw.get("embeddings", ())),
        embedding_norm=raw.get("embedding_norm"),
        final_norm=raw.get("final_norm"),
        heads=tuple(HeadSpec(**h) for h in raw.get("heads", ())),
    )


_FORWARD_KEYS = {"embeddings", "position_ids", "causal", "eps"}


def _forward(raw: dict[str, Any] | None) -> dict[str, Any] | None:
    if raw is None:
        return None
    unknown = set(raw) - _FORWARD_KEYS
    if unknown:
        raise ValueError(f"forward: unknown keys {sorted(unknown)}")
    roles = set(raw.get("embeddings", ())) - {"word", "position", "token_type"}
    if roles or raw.get("position_ids", "arange") not in ("arange", "after_padding"):
        raise ValueError(f"forward: unknown embedding roles {sorted(roles)} or position_ids")
    return dict(raw)


def _override(raw: dict[str, Any], variant: dict[str, Any]) -> dict[str, Any]:
    out = {**raw, **{k: v for k, v in variant.items() if k not in ("when", "stacks")}}
    if "stacks" in variant:
        changes = {st["name"]: st for st in variant["stacks"]}
        unknown = set(changes) - {st["name"] for st in raw.get("stacks", ())}
        if unknown:
            raise ValueError(f"config variant overrides unknown stacks {sorted(unknown)}")
        out["stacks"] = [{**st, **changes.get(st["name"], {})} for st in raw["stacks"]]
    return out


def _build(raw: dict[str, Any]) -> ArchSpec:
    # `checkpoint_layout`: overrides giving the names save_pretrained writes when they differ from the
    # in-memory module names (transformers 5 renames some families on save/load, e.g. ViT)
    layout = raw.get("checkpoint_layout")
    variants = (_build({**{k: v for k, v in raw.items() if k != "checkpoint_layout"}, **layout}),) if layout else ()
    # `config_variants`: the same family under other names when the config says so (T5 v1.1 / mT5: gated FFN in
    # wi_0 / wi_1); each overrides fields of the family (stacks by name, their fields one by one)
    base = {k: v for k, v in raw.items() if k != "config_variants"}
    by_config = tuple((dict(v["when"]), _build(_override(base, v))) for v in raw.get("config_variants", ()))
    # multi-stack families (`stacks`): the top-level layer / attention / ffn / norm are the first stack's
    stacks = tuple(_stack(st) for st in raw.get("stacks", ()))
    first = stacks[0] if stacks else None
    inputs = raw.get("inputs", "tokens")
    return ArchSpec(
        family=raw["family"],
        model_types=tuple(raw["model_types"]),
        base_prefix=raw["base_prefix"],
        layer=first.layer if first else raw["layer"],
        attention=first.attention if first and first.attention else AttentionSpec(**raw["attention"]),
        ffn=first.ffn if first and first.ffn else FFNSpec(**raw["ffn"]),
        norm=first.norm if first else _norm(raw["norm"]),
        stacks=stacks,
        config_keys=raw.get("config_keys", {}),
        output=raw.get("output"),
        forward=_forward(raw.get("forward")),
        embeddings=tuple(raw.get("embeddings", ())),
        embedding_norm=raw.get("embedding_norm"),
        embedding_projection=raw.get("embedding_projection"),
        final_norm=raw.get("final_norm"),
        rope=bool(raw.get("rope", False)),
        conv1d=bool(raw.get("conv1d", False)),
        relative_embeddings=raw.get("relative_embeddings"),
        relative_norm=raw.get("relative_norm"),
        heads=tuple(HeadSpec(**h) for h in raw.get("heads", ())),
        checkpoint_variants=variants,
        config_variants=by_config,
        extra=raw.get("extra", {}),
        inputs=(inputs,) if isinstance(inputs, str) else tuple(inputs),
        n_layers_key=first.n_layers_key if first else raw.get("n_layers_key", "num_hidden_layers"),
        require=raw.get("require", {}),
        residual_group=raw.get("residual_group", "permutation"),
    )


@functools.cache
def all_specs() -> dict[str, ArchSpec]:
    """Every registered family, by family name."""
    specs = [_parse(p) for p in sorted(_FAMILIES.glob("*.yaml"))]
    return {s.family: s for s in specs}


def supported_model_types() -> list[str]:
    """Every ``config.model_type`` some family covers."""
    return sorted(t for s in all_specs().values() for t in s.model_types)


def get_spec(config_or_model_type: Any) -> ArchSpec:
    """The spec for an HF config (or a ``model_type`` string).

    Args:
        config_or_model_type: ``PretrainedConfig``, a config dict, or a ``model_type`` string.

    Returns:
        The family's :class:`ArchSpec` (for a config: the family's variant its values select, if any).

    Raises:
        UnsupportedArchitecture: if no family covers the model type; the message lists those that do.
    """
    if isinstance(config_or_model_type, str):
        model_type = config_or_model_type
    elif isinstance(config_or_model_type, dict):
        model_type = config_or_model_type.get("model_type")
    else:
        model_type = getattr(config_or_model_type, "model_type", None)
    for spec in all_specs().values():
        if model_type in spec.model_types:
            for when, variant in () if isinstance(config_or_model_type, str) else spec.config_variants:
                get = config_or_model_type.get if isinstance(config_or_model_type, dict) else None
                values = {k: get(k) if get else getattr(config_or_model_type, k, None) for k in when}
                if values == when:
                    return variant
            return spec
    raise UnsupportedArchitecture(
        f"unsupported model_type {model_type!r}; supported: {', '.join(supported_model_types())}"
    )
