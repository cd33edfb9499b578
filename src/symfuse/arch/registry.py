"""Family registry: every ``families/*.yaml`` becomes an :class:`ArchSpec`, found by ``model_type``."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import yaml

from symfuse.arch.spec import ArchSpec, AttentionSpec, FFNSpec, HeadSpec, NormSpec
from symfuse.errors import UnsupportedArchitecture

_FAMILIES = Path(__file__).parent / "families"


def _parse(path: Path) -> ArchSpec:
    raw = yaml.safe_load(path.read_text())
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
    }
    unknown = set(raw) - known
    if unknown:  # a spec field nobody reads is a bug, not a comment
        raise ValueError(f"{path.name}: unknown keys {sorted(unknown)}")
    return _build(raw)


def _build(raw: dict[str, Any]) -> ArchSpec:
    # `checkpoint_layout`: overrides giving the names save_pretrained writes when they differ from the
    # in-memory module names (transformers 5 renames some families on save/load, e.g. ViT)
    layout = raw.get("checkpoint_layout")
    variants = (_build({**{k: v for k, v in raw.items() if k != "checkpoint_layout"}, **layout}),) if layout else ()
    return ArchSpec(
        family=raw["family"],
        model_types=tuple(raw["model_types"]),
        base_prefix=raw["base_prefix"],
        layer=raw["layer"],
        attention=AttentionSpec(**raw["attention"]),
        ffn=FFNSpec(**raw["ffn"]),
        norm=NormSpec(**{**raw["norm"], "extra": tuple(raw["norm"].get("extra", ()))}),
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
        extra=raw.get("extra", {}),
        inputs=raw.get("inputs", "tokens"),
        n_layers_key=raw.get("n_layers_key", "num_hidden_layers"),
        require=raw.get("require", {}),
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
        The family's :class:`ArchSpec`.

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
            return spec
    raise UnsupportedArchitecture(
        f"unsupported model_type {model_type!r}; supported: {', '.join(supported_model_types())}"
    )
