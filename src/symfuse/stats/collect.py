"""``collect_stats``: load a checkpoint and a dataset, collect Gram and/or Fisher, write one file per kind."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from symfuse.checkpoint import load_hf_model, resolve_checkpoint
from symfuse.stats.fisher import collect_fisher
from symfuse.stats.gram import collect_gram
from symfuse.stats.io import STAT_KINDS, file_fingerprint, save_stats

log = logging.getLogger(__name__)

LOG_LINES = 10  # INFO lines per statistics kind


def tracked(
    batches: Sequence[Any], what: str, on_progress: Callable[[float], None] | None = None, start: float = 0.0,
    share: float = 1.0,
) -> Iterator[Any]:  # fmt: skip
    """Yield ``batches``; after each, call ``on_progress(start + share * done / total)`` and log ~10 INFO lines.

    Args:
        batches: The batches (a sized sequence).
        what: What the batches are for, in the log lines (e.g. ``"gram"``).
        on_progress: Progress callback (fraction of the whole job, 0..1), or None.
        start: Fraction done before these batches.
        share: Fraction of the whole job these batches are.
    """
    total = len(batches)
    every = max(1, total // LOG_LINES)
    for i, batch in enumerate(batches, 1):
        yield batch
        if i % every == 0 or i == total:
            log.info("%s: batch %d/%d", what, i, total)
        if on_progress is not None:
            on_progress(start + share * i / max(total, 1))


def load_model(model: str | os.PathLike) -> nn.Module:
    """Load a checkpoint folder with the head class named in its config (``architectures``), in eval mode."""
    return load_hf_model(model)


def model_fingerprint(folder: str | os.PathLike) -> str:
    """Hash of a checkpoint folder's config and weight files."""
    folder = Path(folder)
    files = [folder / "config.json", *sorted(folder.glob("*.safetensors"))]
    return file_fingerprint(*[f for f in files if f.exists()])


def _label_map(model: nn.Module, labels: Sequence[str]) -> dict[int, int] | None:
    """Dataset label id -> model label id, when the model names the dataset's labels in another order."""
    l2i = {str(k): int(v) for k, v in (getattr(model.config, "label2id", None) or {}).items()}
    if not labels or not set(labels) <= set(l2i):
        return None
    mapping = {i: l2i[name] for i, name in enumerate(labels)}
    return None if all(i == j for i, j in mapping.items()) else mapping


def collect_stats(
    model: str | Path,
    data: str,
    kinds: Sequence[str],
    out_dir: Path,
    max_examples: int | None = None,
    batch_size: int = 16,
    device: str = "cpu",
    split: str = "train",
    max_length: int = 128,
    fisher_mode: str = "empirical",
    seed: int = 13,
    progress: bool = True,
    on_progress: Callable[[float], None] | None = None,
) -> dict[str, Path]:
    """Collect statistics of a checkpoint on a dataset and write ``<out_dir>/<kind>.safetensors``.

    Args:
        model: Checkpoint folder (or ``"minilm"`` / hub id).
        data: Dataset source for :func:`symfuse.data.load_task_dataset` (shared name, folder, files, hub id).
        kinds: Subset of ``("gram", "fisher")``.
        out_dir: Output folder (created).
        max_examples: Seeded random subset of the split.
        batch_size: Examples per forward pass.
        device: ``cpu`` or ``cuda`` (falls back to CPU when CUDA is absent).
        split: Which split the statistics come from.
        max_length: Truncation length in tokens.
        fisher_mode: ``empirical`` or ``sampled``.
        seed: Subset and sampling seed.
        progress: Show progress bars.
        on_progress: Called with the fraction done (0..1] after every batch of every kind.

    Returns:
        ``{kind: file}``.

    Raises:
        ValueError: on an unknown kind.
    """
    from symfuse.data import load_task_dataset, make_batches

    unknown = [k for k in kinds if k not in STAT_KINDS]
    if unknown:
        raise ValueError(f"unknown statistics kind(s) {unknown}; choose from {list(STAT_KINDS)}")
    folder = resolve_checkpoint(model)
    net = load_model(folder)
    ds = load_task_dataset(data)
    batches = make_batches(ds, folder, split, batch_size, max_length, max_examples, seed)
    common: dict[str, Any] = {
        "model": str(folder),
        "dataset": ds.name,
        "split": split,
        "model_fingerprint": model_fingerprint(folder),
        "dataset_fingerprint": f"{ds.fingerprint}:{split}:{max_examples}:{max_length}:{seed}",
    }
    out_dir = Path(out_dir)
    written: dict[str, Path] = {}
    for i, kind in enumerate(kinds):
        stream = tracked(batches, f"{kind} statistics", on_progress, i / len(kinds), 1 / len(kinds))
        if kind == "gram":
            g = collect_gram(net, stream, device=device, progress=progress)
            meta = {
                **common,
                "kind": "gram",
                "n_tokens": str(g.n_tokens),
                "n_examples": str(g.n_examples),
                "rows": g.rows,
                "conv1d": g.conv1d,
                "same_input": g.same_input,
            }
            written[kind] = save_stats(g.grams, out_dir / "gram.safetensors", meta)
        else:
            f = collect_fisher(
                net,
                stream,
                mode=fisher_mode,
                seed=seed,
                device=device,
                progress=progress,
                label_map=_label_map(net, ds.labels),
            )  # type: ignore[arg-type]
            meta = {
                **common,
                "kind": "fisher",
                "n_tokens": str(f.n_tokens),
                "n_examples": str(f.n_examples),
                "fisher_mode": f.mode,
            }
            written[kind] = save_stats(
                {k: v.float() for k, v in f.fisher.items()}, out_dir / "fisher.safetensors", meta
            )
        log.info("wrote %s statistics %s", kind, written[kind])
    del net
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return written
