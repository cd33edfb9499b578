"""``merge_checkpoints``: merge K checkpoint folders tensor by tensor, streaming from safetensors.

Memory is O(one tensor x K) plus one output shard: tensors and statistics are read one at a time with plain
reads (no mmap, so page-cache pages do not count towards the process), merged, and streamed into the output
by :func:`symfuse.checkpoint.write_checkpoint`. Where a merger reads its inputs unchecked (its output carries any
NaN / inf, traced to its file afterwards), the K tensors can also be read span by span, all K at once, in one
fused pass (:class:`symfuse.merge.base.Chunks`: the weighted mean, RegMean's means and deltas).

Classification heads (tensors outside the base model, e.g. ``classifier.*``, ``pre_classifier.*``,
``classifier.dense.*`` for RoBERTa, ``score.*`` for GPT-2):

* same label set (equal ``id2label`` and head shapes in every model): merged like any other tensor (RegMean
  uses the classifier's Gram like any linear layer's);
* different label sets: ONE merged body, and the heads are kept per dataset. ``out/`` is a complete
  ``save_pretrained`` folder with the merged body and the FIRST model's head; every other model ``i`` gets
  ``out/heads/<name_i>/``, a complete ``save_pretrained`` folder with the same merged body and model i's own head
  and config (``name_i`` = the dataset named in its statistics, else its folder name). ``symfuse_report.json``
  maps each name to its folder (``"."`` for the first);
* union heads (every model has one head over the union of the datasets' classes, label metadata in
  ``config.json``): ONE merged head, each class row merged only over the models that learned that class
  (:mod:`symfuse.merge.heads`).

Every output folder gets a ``README.md`` model card (:mod:`symfuse.model_card`): base, inputs and their fine-tuning
metrics, strategy, symmetries, heads.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from symfuse.checkpoint import CheckpointReader, write_checkpoint
from symfuse.device import resolve_device
from symfuse.errors import CheckpointError, MissingStats, NonFiniteError
from symfuse.io import BufferPool, check_finite_tensor, parallel_reads
from symfuse.merge.base import LazyTensors, TensorInputs, chunked_sum, weighted_mean
from symfuse.merge.head_refit import RefitOptions, check_refittable, refit_batches, refit_heads
from symfuse.merge.heads import merge_class_rows, union_heads, write_label_space
from symfuse.merge.registry import MERGERS
from symfuse.model_card import CARD, input_metrics, model_card
from symfuse.outputs import atomic_output_dir, check_output
from symfuse.stats.io import STAT_KINDS, StatsFile
from symfuse.stats.ownership import check_stats_belong

log = logging.getLogger(__name__)

REPORT = "symfuse_report.json"
SHARD_BYTES = 128 * 1024**2


class StreamingReader(CheckpointReader):
    """A :class:`CheckpointReader` that reads each tensor with plain reads instead of mmap."""

    def get(self, name: str, pool: BufferPool | None = None, slot: str = "") -> torch.Tensor:
        """Load one tensor into new memory, or into ``pool``'s ``slot`` (see :class:`symfuse.io.TensorFile`)."""
        return self.tensor_file(name).get(name, pool, slot)


def head_names(reader: CheckpointReader) -> set[str]:
    """Tensors outside the base model (task heads); empty for a bare base model."""
    if not reader.prefix:
        return set()
    return {n for n in reader.names() if not n.startswith(reader.prefix)}


def _labels(reader: CheckpointReader) -> list[str]:
    id2label = getattr(reader.config, "id2label", None) or {}
    return [str(id2label[i]) for i in sorted(id2label)]


def _resolve_stats(
    kinds: frozenset[str], stats: Sequence[str | os.PathLike] | None, models: Sequence[Path]
) -> dict[str, list[StatsFile]]:
    """The statistics files of each required kind, one per model (from folders or files), checked to belong.

    Raises:
        MissingStats: statistics not given, or not one per model.
        StatsMismatchError: statistics of another model, or a folder mixing two models' statistics.
    """
    if not kinds:
        return {}
    if not stats:
        raise MissingStats(f"this strategy needs {sorted(kinds)} statistics: pass --stats (one folder per model)")
    k = len(models)
    found: dict[str, list[StatsFile]] = {kind: [] for kind in kinds}
    owners: list[tuple[Path, list[StatsFile]]] = []
    for p in map(Path, stats):
        if p.is_dir():
            mine = []
            for kind in sorted(kinds):
                mine.append(StatsFile(p / f"{kind}.safetensors"))
                found[kind].append(mine[-1])
            # every stats file of the folder, used or not, must belong to one model
            others = [p / f"{kind}.safetensors" for kind in STAT_KINDS if kind not in kinds]
            mine += [StatsFile(f) for f in others if f.is_file()]
            owners.append((p, mine))
        else:
            sf = StatsFile(p)
            if sf.kind in found:
                found[sf.kind].append(sf)
            owners.append((p, [sf]))
    for kind, files in found.items():
        if len(files) != k:
            raise MissingStats(
                f"{len(files)} {kind} statistics file(s) for {k} models; give one stats folder (or file) per model"
            )
    cache: dict[Path, str] = {}
    if len(owners) == k:  # one folder (or file) per model: pair them in order
        for model, (where, files) in zip(models, owners, strict=True):
            check_stats_belong(model, files, where, cache)
    else:  # one file per kind and model, in model order within each kind
        for i, model in enumerate(models):
            check_stats_belong(model, [files[i] for files in found.values()], model, cache)
    return found


def _all_finite(t: torch.Tensor) -> bool:
    """Whether every element is finite (one reduction; element-wise only when the sum is not finite)."""
    return math.isfinite(chunked_sum(t)) or bool(torch.isfinite(t).all())


def _finite_loader(
    load: Callable[[BufferPool | None, str], torch.Tensor], name: str, where: Path
) -> Callable[[BufferPool | None, str], torch.Tensor]:
    """``load`` whose result is checked for NaN / inf (naming ``where`` and ``name``) before any maths sees it."""
    return lambda p, s: check_finite_tensor(load(p, s), name, where)


def _gram_inputs(
    grams: Sequence[StatsFile],
    module: str,
    pool: BufferPool | None,
    to_dev: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
) -> LazyTensors:
    """The K Grams of ``module`` (checked finite on access; RegMean checks them in its own pass instead).

    On the CPU (``pool`` given) they can also be read in spans; elsewhere each is read whole and moved by ``to_dev``.
    """
    return LazyTensors(
        [lambda p, s, g=g: to_dev(g.get(module, p, s)) for g in grams],
        pool,
        "gram",
        checks=[lambda t, g=g: check_finite_tensor(t, module, g.path) for g in grams],
        spans=[(g.shape(module), g.dtype(module), lambda o, f, g=g: g.read_span(module, o, f)) for g in grams]
        if pool is not None
        else None,
    )


def _tensor_spans(name: str, first: torch.Tensor, others: Sequence[CheckpointReader]) -> list:
    """Spans of K models' tensor ``name`` (see :class:`LazyTensors`), unchecked: model 0's from ``first``."""
    flat = first.detach().contiguous().view(-1)
    spans = [(tuple(first.shape), first.dtype, lambda o, f: o.copy_(flat[f : f + o.numel()]))]
    for r in others:
        tf = r.tensor_file(name)
        spans.append((tf.shape(name), tf.dtype(name), lambda o, f, tf=tf: tf.read_span(name, o, f)))
    return spans


def merge_checkpoints(
    strategy: str,
    models: Sequence[str | Path],
    out: Path,
    stats: Sequence[Path] | None = None,
    base: str | Path | None = None,
    overwrite: bool = False,
    card: Mapping[str, Any] | None = None,
    head_refit: RefitOptions | Mapping[str, Any] | None = None,
    device: str | torch.device = "cpu",
    **params: Any,
) -> Path:
    """Merge K checkpoints with a registered strategy and write a ``save_pretrained`` folder.

    Args:
        strategy: A registered strategy (:data:`symfuse.merge.registry.MERGERS`).
        models: K checkpoint folders (same architecture and body shapes).
        out: Output folder (written atomically, with ``symfuse_report.json``).
        stats: One statistics folder (``gram.safetensors`` / ``fisher.safetensors``) or file per model, in model
            order, when the strategy needs statistics.
        base: The base checkpoint (task-vector strategies).
        overwrite: Replace an existing ``out``.
        card: Facts for the ``README.md`` model card the merger cannot know: ``base_model`` (name of the base the
            inputs were fine-tuned from; default ``base``), ``symmetries`` (the inputs were matched with; default
            none), ``extra`` (more front-matter facts, e.g. the run id).
        head_refit: Refit every task head to the merged body on each model's own data
            (:mod:`symfuse.merge.head_refit`; its ``data`` is loaded before the merge starts), recorded under the
            report's ``heads.refit``; None: heads as merged.
        device: Where the merge's maths runs (``cpu``, ``cuda``, ``cuda:N``, ``auto``). Off the CPU, one tensor of
            the K models (with its statistics) is on the device at a time, merged with whole-tensor torch ops,
            and written from host memory.
        **params: Strategy parameters (e.g. ``alpha=0.9``, ``weights=[...]``, ``density=0.2``); unknown ones raise.
            A merger that reads the models' data (``needs_data``: regmean++, ``data=[one dataset per model]``) does
            its work in :meth:`~symfuse.merge.base.Merger.prepare`, once the inputs are checked.

    Returns:
        ``out``.

    Raises:
        ValueError: unknown strategy or parameter.
        OutputExistsError: ``out`` exists and ``overwrite`` is False.
        MissingStats: required statistics or base model not given, or a statistic missing for a layer.
        CheckpointError: models whose body tensors differ in names or shapes.
    """
    start = time.perf_counter()
    MERGERS.require([strategy])  # one line naming the choices
    dev = resolve_device(device)
    on_cpu = dev.type == "cpu"  # the CPU reads into reused buffers and fuses passes over spans; a device does not
    if not models:
        raise ValueError("merge needs at least one model")
    check_output(out, overwrite)
    if "device" in MERGERS[strategy].Params.model_fields:  # a merger that runs models (regmean++): the merge's device
        params.setdefault("device", str(dev))
    merger = MERGERS[strategy](**params)
    refit = RefitOptions.model_validate(head_refit) if head_refit is not None else None
    if refit is not None and "device" not in refit.model_fields_set:  # the refit's forward passes: the merge's device
        refit = refit.model_copy(update={"device": str(dev)})
    readers = [StreamingReader(m) for m in models]
    k = len(readers)
    if merger.needs_base and base is None:
        raise MissingStats(f"strategy {strategy!r} works on task vectors: pass the base model (--base)")
    base_reader = StreamingReader(base) if base is not None else None
    files = _resolve_stats(merger.required_stats, stats, [r.path for r in readers])
    weights = merger.model_weights(k)
    r0 = readers[0]

    heads = head_names(r0)
    union = union_heads([r.config for r in readers], [r.path for r in readers])  # None: no union label space
    learned = union.learned if union is not None else None
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

    refit_data = None
    if refit is not None:  # a model without a head, or bad data: refused now, not after the merge
        for r in readers:
            check_refittable(r.path, r.config, {n: r.shape(n) for n in head_names(r)})
        refit_data = refit_batches([r.path for r in readers], refit)
    merger.prepare([r.path for r in readers], frozenset(heads) if separate else frozenset())  # e.g. RegMean++
    grams, fishers = files.get("gram"), files.get("fisher")
    # Gram keys whose module reads the same input as another in EVERY model (q / k / v): one factorisation.
    same_input: dict[str, str] = {}
    if grams is not None:
        pairs = [g.same_input for g in grams]
        same_input = {k: v for k, v in pairs[0].items() if all(p.get(k) == v for p in pairs[1:])}
    pool = BufferPool() if on_cpu else None  # reused read buffers: no page faults for fresh memory on every tensor
    merger.pool, merger.device = pool, dev
    to_dev = (lambda t: t) if on_cpu else (lambda t: t.to(dev))

    def base_tensor(name: str) -> torch.Tensor | None:
        if base_reader is None:
            return None
        bname = base_reader.prefix + name[len(r0.prefix) :] if name.startswith(r0.prefix) else name
        if not base_reader.has(bname):
            return None
        return to_dev(check_finite_tensor(base_reader.get(bname), bname, base_reader.file_of(bname)))

    def merge_one(name: str, first: torch.Tensor) -> torch.Tensor:
        rows = union is not None and union.per_class(name, first.shape, heads)  # merged per class, over its learners
        # a merger whose every input enters a sum carries any NaN / inf into its output: its inputs are read
        # unchecked, and checked (to name the file) only when the output is not finite
        deferred = (
            on_cpu
            and merger.propagates_nonfinite
            and first.is_floating_point()
            and not rows
            and not (separate and name in heads)
        )
        if not deferred:
            check_finite_tensor(first, name, r0.file_of(name))
        merged = _merge_one(name, first, rows, deferred)
        if (
            merged is not first
            and merged.is_floating_point()
            and not (merger.output_finite(merged) or _all_finite(merged))
        ):
            if deferred:  # name the input that carried it
                check_finite_tensor(first, name, r0.file_of(name))
                for r in readers[1:]:
                    check_finite_tensor(r.get(name), name, r.file_of(name))
                for f in fishers if fishers is not None and all(f.has(name) for f in fishers) else []:
                    check_finite_tensor(f.get(name), name, f.path)
            raise NonFiniteError(
                f"{out}: merged tensor {name!r} came out NaN / inf with {strategy} (inputs were finite) — nothing "
                "was written; try --dtype float64, a larger --epsilon / smaller --alpha, or another strategy"
            )
        if not on_cpu:
            return merged.cpu()
        return merged

    def _merge_one(name: str, first: torch.Tensor, rows: bool, deferred: bool) -> torch.Tensor:
        if separate and name in heads:
            return first
        if not first.is_floating_point():
            return first  # integer / bool tensors pass through untouched
        checked = (lambda load, where: load) if deferred else (lambda load, where: _finite_loader(load, name, where))
        tensors = LazyTensors(
            [lambda p, s: p.take(s, first.shape, first.dtype).copy_(first) if p is not None else to_dev(first.clone())]
            + [checked(lambda p, s, r=r: to_dev(r.get(name, p, s)), r.file_of(name)) for r in readers[1:]],
            pool,
            "tensor",
            spans=_tensor_spans(name, first, readers[1:]) if deferred else None,  # unchecked: only when deferred
        )
        b = base_tensor(name)
        if merger.needs_base and b is None:  # e.g. a head absent from a bare base model
            merger.count("no_base_averaged")
            if rows:
                mean = lambda t: weighted_mean(t.tensors, t.weights)  # noqa: E731
                return merge_class_rows(mean, TensorInputs(name, tensors, weights), learned)
            return weighted_mean(tensors, weights)
        fisher = None
        if fishers is not None and all(f.has(name) for f in fishers):
            loads = [checked(lambda p, s, f=f: to_dev(f.get(name, p, s)), f.path) for f in fishers]
            fisher = LazyTensors(loads, pool, "fisher")
        gram, conv1d = None, False
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if grams is not None and module is not None and first.dim() == 2:
            have = [g.has(module) for g in grams]
            if all(have):
                gram = _gram_inputs(grams, module, pool, to_dev)
                conv1d = module in grams[0].conv1d
            elif any(have):
                raise MissingStats(f"Gram of {module} is missing from some models' statistics; recollect them")
        if gram is None and module is not None and first.dim() == 2:
            gram = merger.supplied_grams(module)  # Grams the merger collected itself (RegMean++'s tail)
        key = same_input.get(module, module) if gram is not None else None
        inputs = TensorInputs(name, tensors, weights, b, fisher, gram, conv1d, key)
        return merge_class_rows(merger.merge_tensor, inputs, learned) if rows else merger.merge_tensor(inputs)

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
        try:
            with parallel_reads():  # the merge's reads run between its BLAS calls: the cores are free
                write_checkpoint(r0, tmp, replace=merge_one, shard_bytes=SHARD_BYTES, overwrite=True)
        finally:
            merger.close()
        if union is not None:  # the merged head learned every class some model learned
            write_label_space(tmp, union.merged())
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
        policy = "union" if union is not None else ("per-dataset" if separate else "merged")
        refitted = None
        if refit is not None and refit_data is not None:
            refitted = refit_heads(tmp, names if separate else dict.fromkeys(names, "."), [r.path for r in readers],
                                   refit_data, refit.ridge, learned, refit.device)  # fmt: skip
        report = {
            "strategy": strategy,
            "params": merger.params.model_dump(),
            "models": [str(m) for m in models],
            "stats": [str(s) for s in stats or []],
            "base": str(base) if base is not None else None,
            "heads": {
                "policy": policy,
                "folders": names if separate else {},
                **({"learners": union.learners()} if union is not None else {}),
                **({"refit": refitted} if refitted is not None else {}),
            },
            "counters": merger.counters,
            "seconds": round(time.perf_counter() - start, 3),
        }
        (tmp / REPORT).write_text(json.dumps(report, indent=2))
        card = dict(card or {})
        inputs = [
            {"name": name, "dataset": name, "path": str(m), "metrics": input_metrics(m)}
            for name, m in zip(names, models, strict=True)
        ]
        text = model_card(
            strategy, report["params"], inputs, json.loads((tmp / "config.json").read_text()),
            base=card.get("base_model") or (str(base) if base is not None else None),
            symmetries=card.get("symmetries") or (), heads=policy, extra=card.get("extra"),
            head_refit=refit.ridge if refit is not None else None,
        )  # fmt: skip
        (tmp / CARD).write_text(text)
    log.info("merged %d models with %s into %s in %.1f s", k, strategy, out, report["seconds"])
    return out
