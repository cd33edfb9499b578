"""``merge_checkpoints``: merge K checkpoint folders tensor by tensor, streaming from safetensors.

Memory is O(one tensor x K) plus one output shard: tensors and statistics are read one at a time with plain
reads (no mmap, so page-cache pages do not count towards the process), merged, and streamed into the output
by :func:`symfuse.checkpoint.write_checkpoint`.

Classification heads (tensors outside the base model, e.g. ``classifier.*``, ``pre_classifier.*``,
``classifier.dense.*`` for RoBERTa, ``score.*`` for GPT-2):

* same label set (equal ``id2label`` and head shapes in every model): merged like any other tensor (RegMean
  uses the classifier's Gram like any linear layer's);
* different label sets: ONE merged body, and the heads are kept per dataset. ``out/`` is a complete
  ``save_pretrained`` folder with the merged body and the FIRST model's head; every other model ``i`` gets
  ``out/heads/<name_i>/``, a complete ``save_pretrained`` folder with the same merged body and model i's own head
  and config (``name_i`` = the dataset named in its statistics, else its folder name). ``symfuse_report.json``
  maps each name to its folder (``"."`` for the first).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from symfuse.checkpoint import CheckpointReader, write_checkpoint
from symfuse.errors import CheckpointError, MissingStats
from symfuse.merge.base import LazyTensors, TensorInputs, weighted_mean
from symfuse.outputs import atomic_output_dir, check_output
from symfuse.stats.io import BufferPool, SafetensorsFile, StatsFile

log = logging.getLogger(__name__)

REPORT = "symfuse_report.json"
SHARD_BYTES = 128 * 1024**2


class StreamingReader(CheckpointReader):
    """A :class:`CheckpointReader` that reads each tensor with plain reads instead of mmap."""

    def get(self, name: str, pool: BufferPool | None = None, slot: str = "") -> torch.Tensor:
        """Load one tensor into new memory, or into ``pool``'s ``slot`` (see :class:`SafetensorsFile`)."""
        file = self._files.get(name)
        if file is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} not found")
        handle = self._handles.get(file)
        if handle is None:
            handle = self._handles[file] = SafetensorsFile(file)
        return handle.get(name, pool, slot)

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of a stored tensor without reading it."""
        file = self._files[name]
        handle = self._handles.get(file)
        if handle is None:
            handle = self._handles[file] = SafetensorsFile(file)
        return handle.shape(name)


def head_names(reader: CheckpointReader) -> set[str]:
    """Tensors outside the base model (task heads); empty for a bare base model."""
    if not reader.prefix:
        return set()
    return {n for n in reader.names() if not n.startswith(reader.prefix)}


def _labels(reader: CheckpointReader) -> list[str]:
    id2label = getattr(reader.config, "id2label", None) or {}
    return [str(id2label[i]) for i in sorted(id2label)]


def _resolve_stats(
    kinds: frozenset[str], stats: Sequence[str | os.PathLike] | None, k: int
) -> dict[str, list[StatsFile]]:
    """The statistics files of each required kind, one per model (from folders or files)."""
    if not kinds:
        return {}
    if not stats:
        raise MissingStats(f"this strategy needs {sorted(kinds)} statistics: pass --stats (one folder per model)")
    found: dict[str, list[StatsFile]] = {kind: [] for kind in kinds}
    for p in map(Path, stats):
        if p.is_dir():
            for kind in kinds:
                found[kind].append(StatsFile(p / f"{kind}.safetensors"))
        else:
            sf = StatsFile(p)
            if sf.kind in found:
                found[sf.kind].append(sf)
    for kind, files in found.items():
        if len(files) != k:
            raise MissingStats(
                f"{len(files)} {kind} statistics file(s) for {k} models; give one stats folder (or file) per model"
            )
    return found


def merge_checkpoints(
    strategy: str,
    models: Sequence[str | Path],
    out: Path,
    stats: Sequence[Path] | None = None,
    base: str | Path | None = None,
    overwrite: bool = False,
    **params: Any,
) -> Path:
    """Merge K checkpoints with a registered strategy and write a ``save_pretrained`` folder.

    Args:
        strategy: A key of :data:`symfuse.merge.MERGERS`.
        models: K checkpoint folders (same architecture and body shapes).
        out: Output folder (written atomically, with ``symfuse_report.json``).
        stats: One statistics folder (``gram.safetensors`` / ``fisher.safetensors``) or file per model, in model
            order, when the strategy needs statistics.
        base: The base checkpoint (task-vector strategies).
        overwrite: Replace an existing ``out``.
        **params: Strategy parameters (e.g. ``alpha=0.9``, ``weights=[...]``, ``density=0.2``); unknown ones raise.

    Returns:
        ``out``.

    Raises:
        ValueError: unknown strategy or parameter.
        OutputExistsError: ``out`` exists and ``overwrite`` is False.
        MissingStats: required statistics or base model not given, or a statistic missing for a layer.
        CheckpointError: models whose body tensors differ in names or shapes.
    """
    from symfuse.merge import MERGERS

    start = time.perf_counter()
    if strategy not in MERGERS:
        raise ValueError(f"unknown merge strategy {strategy!r}; choose from {sorted(MERGERS)}")
    if not models:
        raise ValueError("merge needs at least one model")
    check_output(out, overwrite)
    merger = MERGERS[strategy](**params)
    readers = [StreamingReader(m) for m in models]
    k = len(readers)
    if merger.needs_base and base is None:
        raise MissingStats(f"strategy {strategy!r} works on task vectors: pass the base model (--base)")
    base_reader = StreamingReader(base) if base is not None else None
    files = _resolve_stats(merger.required_stats, stats, k)
    weights = merger.model_weights(k)
    r0 = readers[0]

    heads = head_names(r0)
    separate = bool(heads) and not all(
        head_names(r) == heads and _labels(r) == _labels(r0) and all(r.shape(n) == r0.shape(n) for n in heads)
        for r in readers[1:]
    )
    body = [n for n in r0.names() if not (separate and n in heads)]
    for r in readers[1:]:
        rbody = {n for n in r.names() if not (separate and n in head_names(r))}
        if rbody != set(body):
            diff = sorted(rbody.symmetric_difference(body))[:5]
            raise CheckpointError(f"{r.path}: tensors differ from {r0.path} (e.g. {diff}); models cannot be merged")
        for n in body:
            if r.shape(n) != r0.shape(n):
                raise CheckpointError(f"{r.path}: {n} has shape {r.shape(n)}, model 0 has {r0.shape(n)}")

    grams, fishers = files.get("gram"), files.get("fisher")
    # Gram keys whose module reads the same input as another in EVERY model (q / k / v): one factorisation.
    same_input: dict[str, str] = {}
    if grams is not None:
        pairs = [g.same_input for g in grams]
        same_input = {k: v for k, v in pairs[0].items() if all(p.get(k) == v for p in pairs[1:])}
    pool = BufferPool()  # reused read buffers: no page faults for fresh memory on every tensor
    merger.pool = pool

    def base_tensor(name: str) -> torch.Tensor | None:
        if base_reader is None:
            return None
        bname = base_reader.prefix + name[len(r0.prefix) :] if name.startswith(r0.prefix) else name
        return base_reader.get(bname) if base_reader.has(bname) else None

    def merge_one(name: str, first: torch.Tensor) -> torch.Tensor:
        if separate and name in heads:
            return first
        if not first.is_floating_point():
            return first
        tensors = LazyTensors(
            [lambda p, s: p.take(s, first.shape, first.dtype).copy_(first) if p is not None else first.clone()]
            + [lambda p, s, r=r: r.get(name, p, s) for r in readers[1:]],
            pool,
            "tensor",
        )
        b = base_tensor(name)
        if merger.needs_base and b is None:  # e.g. a head absent from a bare base model
            merger.count("no_base_averaged")
            return weighted_mean(tensors, weights)
        fisher = None
        if fishers is not None and all(f.has(name) for f in fishers):
            fisher = LazyTensors([lambda p, s, f=f: f.get(name, p, s) for f in fishers], pool, "fisher")
        gram, conv1d = None, False
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if grams is not None and module is not None and first.dim() == 2:
            have = [g.has(module) for g in grams]
            if all(have):
                gram = LazyTensors([lambda p, s, g=g: g.get(module, p, s) for g in grams], pool, "gram")
                conv1d = module in grams[0].conv1d
            elif any(have):
                raise MissingStats(f"Gram of {module} is missing from some models' statistics; recollect them")
        key = same_input.get(module, module) if gram is not None else None
        return merger.merge_tensor(TensorInputs(name, tensors, weights, b, fisher, gram, conv1d, key))

    names: dict[str, str] = {}
    for i, m in enumerate(models):
        ds = None
        for kind_files in files.values():
            ds = kind_files[i].meta.get("dataset")
        name = str(ds or Path(m).name or f"model{i}")
        while name in names:
            name = f"{name}-{i}"
        names[name] = "." if i == 0 else f"heads/{name}"
    out = Path(out)
    with atomic_output_dir(out, overwrite=overwrite) as tmp:
        write_checkpoint(r0, tmp, replace=merge_one, shard_bytes=SHARD_BYTES, overwrite=True)
        if separate:
            merged = StreamingReader(tmp)
            for rel, r in zip(names.values(), readers, strict=True):
                if rel == ".":
                    continue
                write_checkpoint(
                    r,
                    tmp / rel,
                    replace=lambda n, t, r=r: t if n in head_names(r) else merged.get(n),
                    shard_bytes=SHARD_BYTES,
                )
        report = {
            "strategy": strategy,
            "params": merger.params.model_dump(),
            "models": [str(m) for m in models],
            "stats": [str(s) for s in stats or []],
            "base": str(base) if base is not None else None,
            "heads": {"policy": "per-dataset" if separate else "merged", "folders": names if separate else {}},
            "counters": merger.counters,
            "seconds": round(time.perf_counter() - start, 3),
        }
        (tmp / REPORT).write_text(json.dumps(report, indent=2))
    log.info("merged %d models with %s into %s in %.1f s", k, strategy, out, report["seconds"])
    return out
