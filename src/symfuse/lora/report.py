"""The merged adapter's ``adapter_config.json`` and the merge's ``symfuse_report.json``."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from symfuse.lora.adapter import LoraAdapter
from symfuse.merge.base import Merger

REPORT = "symfuse_report.json"
# keys that select modules besides target_modules: dropped when the output names its modules one by one
_SELECTORS = ("layers_to_transform", "layers_pattern", "exclude_modules")


def adapter_config(ads: Sequence[LoraAdapter], rank: int, keys: Sequence[str]) -> dict[str, Any]:
    """The first adapter's config with the merged adapter's rank, scale 1 and modules.

    ``lora_alpha = r`` and no rslora (scale 1: the stored ``B A`` is the update), no rank / alpha patterns (one
    rank, zero-padded where a module needs less). ``target_modules``: the adapters' own when they all agree, else
    every merged module by its full name (PEFT matches a name by suffix).
    """
    cfg = dict(ads[0].config)
    cfg.update(r=rank, lora_alpha=rank, use_rslora=False, rank_pattern={}, alpha_pattern={}, inference_mode=True)
    same = all(
        ad.config.get("target_modules") == cfg.get("target_modules")
        and all(ad.config.get(s) == cfg.get(s) for s in _SELECTORS)
        for ad in ads[1:]
    )
    if not same:
        cfg["target_modules"] = sorted(keys)
        cfg.update(dict.fromkeys(_SELECTORS))
    return cfg


def write_report(
    tmp: Path,
    strategy: str,
    merger: Merger,
    basis: str,
    ads: Sequence[LoraAdapter],
    weights: Sequence[float],
    base: Any,
    into_base: bool,
    rank: int,
    errors: Mapping[str, float],
    start: float,
    heads: Sequence[str] = (),
) -> dict[str, Any]:
    """Write ``symfuse_report.json``: inputs, strategy, basis, output kind and rank, truncation errors, seconds.

    ``heads``: where each adapter's saved head went, in order (``.``: the output itself); none: no saved heads.
    """
    report = {
        "strategy": strategy,
        "params": merger.params.model_dump(by_alias=True),
        "basis": basis,
        "adapters": [str(ad.path) for ad in ads],
        "weights": list(weights),
        "dora": ads[0].dora,
        "base": str(base) if base is not None else None,
        "output": "model" if into_base else "adapter",
        "rank": None if into_base else rank,
        "truncation": {
            "max_relative_error": max(errors.values(), default=0.0),
            "modules": dict(errors),
        },
        "heads": [{"adapter": str(ad.path), "folder": rel} for ad, rel in zip(ads, heads, strict=False)],
        "seconds": round(time.perf_counter() - start, 3),
    }
    (tmp / REPORT).write_text(json.dumps(report, indent=2))
    return report
