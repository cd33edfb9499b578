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
import os
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from symfuse.checkpoint import CheckpointReader, write_checkpoint
from symfuse.config_json import update_config_json
from symfuse.data.vocab import check_same_vocabulary
from symfuse.device import resolve_device
from symfuse.errors import CheckpointError, MissingStats, StatsMismatchError
from symfuse.io import BufferPool, check_finite, parallel_reads, tensor_difference
from symfuse.merge.head_refit import RefitOptions, check_refittable, refit_batches, refit_heads
from symfuse.merge.heads import head_names, union_heads, write_label_space
from symfuse.merge.plan import MergePlan, out_dtype_of
from symfuse.merge.readers import StreamingReader, counterpart, untie_mixed
from symfuse.merge.registry import MERGERS
from symfuse.merge.tensor_merge import TensorMerge, _gram_inputs  # noqa: F401  (_gram_inputs: tests read spans)
from symfuse.model_card import CARD, input_metrics, model_card, trained_on
from symfuse.outputs import atomic_output_dir, check_output
from symfuse.stats.io import STAT_KINDS, StatsFile
from symfuse.stats.ownership import check_stats_belong

log = logging.getLogger(__name__)

REPORT = "symfuse_report.json"
SHARD_BYTES = 128 * 1024**2


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
                if mine[-1].kind and mine[-1].kind != kind:  # a renamed file: "no Gram of ..." named another cause
                    raise StatsMismatchError(f"{mine[-1].path}: holds {mine[-1].kind} statistics (its metadata), not "
                                             f"{kind} — name it {mine[-1].kind}.safetensors, or collect {kind}: "
                                             f"symfuse stats MODEL --data DATA --kind {kind}")  # fmt: skip
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
    cache: dict[Any, str] = {}  # fingerprints, hashed once per model
    if len(owners) == k:  # one folder (or file) per model: pair them in order
        for model, (where, files) in zip(models, owners, strict=True):
            check_stats_belong(model, files, where, cache)
    else:  # one file per kind and model, in model order within each kind
        for i, model in enumerate(models):
            check_stats_belong(model, [files[i] for files in found.values()], model, cache)
    return found


_ONE_SHAPE = (
    "a merge is tensor by tensor, so the models must have the same tensors and shapes (fine-tunes of one base); "
    "`symfuse inspect A B` lists what differs"
)


def _check_bodies(readers: Sequence[CheckpointReader], separate: bool) -> None:
    """Refuse models whose body tensors (heads aside when kept per model) differ in names or shapes."""
    r0 = readers[0]
    for r in readers[1:]:
        if diff := tensor_difference(r0, r, skip=lambda reader, n: separate and n in head_names(reader)):
            _refuse_other_type(r, r0)
            raise CheckpointError(f"{diff} — {_ONE_SHAPE}")


def _refuse_other_type(r: CheckpointReader, r0: CheckpointReader) -> None:
    """Say that two models whose tensors differ are of different architectures, when their configs say so."""
    if r.config.model_type != r0.config.model_type:
        raise CheckpointError(
            f"{r.path}: a {r.config.model_type} model, and {r0.path} a {r0.config.model_type} one — merge models of "
            "one architecture (fine-tunes of one base, or models trained alike)"
        )


def _check_fisher(fisher: StatsFile, reader: CheckpointReader) -> None:
    """Refuse a Fisher file that names none of its model's tensors, or holds one of another shape (headers only).

    Tensors it has no entry for are averaged with the model weights (logged).
    """
    keys = fisher.keys()
    floats = [n for n in reader.names() if reader.dtype(n).is_floating_point]
    known = [k for k in keys if reader.has(k)]
    fix = f"recollect it with `symfuse stats {reader.path} --data DATA --kind fisher`"
    if keys and not known:
        raise StatsMismatchError(
            f"{fisher.path}: names none of {reader.path}'s tensors (it has {keys[0]!r}, the model {floats[0]!r}): "
            f"statistics of another model — {fix}"
        )
    for k in known:
        if tuple(fisher.shape(k)) != tuple(reader.shape(k)):
            raise StatsMismatchError(
                f"{fisher.path}: the Fisher of {k} has shape {tuple(fisher.shape(k))}, {reader.path} holds "
                f"{tuple(reader.shape(k))}: statistics of another model — {fix}"
            )
    missing = len(set(floats) - set(known))
    if missing:
        log.warning("%s: no Fisher for %d of %s's %d tensors; they are averaged", fisher.path, missing,
                    reader.path, len(floats))  # fmt: skip


def _warn_mixed_dtypes(readers: Sequence[CheckpointReader], out_dtype: torch.dtype | None) -> None:
    """Say so when the models' floating tensors differ in dtype and no ``out_dtype`` is given: model 0's is written."""

    def stored(r: CheckpointReader) -> torch.dtype | None:
        kinds = [r.dtype(n) for n in r.names() if r.dtype(n).is_floating_point]
        return max(set(kinds), key=kinds.count) if kinds else None

    dtypes = [stored(r) for r in readers]
    if out_dtype is None and len({d for d in dtypes if d is not None}) > 1:
        held = ", ".join(f"{r.path}: {str(d).removeprefix('torch.')}" for r, d in zip(readers, dtypes, strict=True))
        log.warning(
            "the models' dtypes differ (%s): the merged tensors are written in the first model's, %s — list "
            "first the model whose dtype the merge should have, or name it (--out-dtype)",
            held,
            str(dtypes[0]).removeprefix("torch."),
        )


def _head_folders(
    models: Sequence[str | Path], files: Mapping[str, list[StatsFile]], given: Sequence[str] | None = None
) -> dict[str, str]:
    """Each model's name -> its head folder (``.`` for the first).

    One rule: the name ``given`` for it, else the dataset the model was trained on (its statistics' dataset, else its
    ``symfuse_train.json``), else its folder name.
    """
    names: dict[str, str] = {}
    for i, m in enumerate(models):
        ds = trained_on(m)
        for kind_files in files.values():
            ds = kind_files[i].meta.get("dataset") or ds
        name = str(given[i] if given else ds or Path(m).name or f"model{i}")
        while name in names:
            name = f"{name}-{i}"
        names[name] = "." if i == 0 else f"heads/{name}"
    return names


def _check_base(base: CheckpointReader, r0: CheckpointReader, heads: Collection[str]) -> None:
    """Refuse a base of another architecture or size than the models (its tensors were skipped: a plain average).

    A bare base model (no task head, or a head of another size) is a base: tensors it lacks or holds in another shape
    are averaged (``no_base_averaged``); but a body tensor of another shape, another ``model_type``, or a base holding
    under half of the models' body tensors is another model.
    """
    fix = "give the base the models were fine-tuned from"
    if base.config.model_type != r0.config.model_type:
        raise CheckpointError(f"--base {base.path}: a {base.config.model_type} model, and {r0.path} a "
                              f"{r0.config.model_type} one — {fix}")  # fmt: skip
    body = [n for n in r0.names() if n not in heads]
    found = 0
    for name in body:
        bname = counterpart(name, r0, base)
        if base.has(bname):
            found += 1
            if base.shape(bname) != r0.shape(name):
                raise CheckpointError(f"--base {base.path}: {bname} has shape {base.shape(bname)}, {r0.path} "
                                      f"{r0.shape(name)} — {fix}")  # fmt: skip
    if 2 * found < len(body):
        raise CheckpointError(f"--base {base.path}: holds {found} of the {len(body)} body tensors of {r0.path} — {fix}")


def plan_merge(
    strategy: str,
    models: Sequence[str | Path],
    out: Path,
    stats: Sequence[Path] | None,
    base: str | Path | None,
    head_refit: RefitOptions | Mapping[str, Any] | None,
    device: str | torch.device,
    params: dict[str, Any],
    model_names: Sequence[str] | None = None,
    out_dtype: str | torch.dtype | None = None,
) -> MergePlan:
    """Check every input and set the merge up (see :func:`merge_checkpoints` for the arguments and errors)."""
    dev, written = resolve_device(device), out_dtype_of(out_dtype)
    if not models:
        raise ValueError("merge needs at least one model")
    if "device" in MERGERS[strategy].Params.model_fields:  # a merger that runs models (regmean++): the merge's device
        params.setdefault("device", str(dev))
    merger = MERGERS[strategy](**params)
    merger.check_model_count(len(models))
    refit = RefitOptions.model_validate(head_refit) if head_refit is not None else None
    if refit is not None and "device" not in refit.model_fields_set:  # the refit's forward passes: the merge's device
        refit = refit.model_copy(update={"device": str(dev)})
    readers = [StreamingReader(m) for m in models]
    if merger.needs_base and base is None:
        raise MissingStats(f"strategy {strategy!r} works on task vectors: pass the base model (--base)")
    base_reader = StreamingReader(base) if base is not None else None
    untie_mixed([*readers, *([base_reader] if base_reader is not None else [])])
    files = _resolve_stats(merger.required_stats, stats, [r.path for r in readers])
    r0 = readers[0]
    heads = head_names(r0)
    union = union_heads([r.config for r in readers], [r.path for r in readers])  # None: no union label space
    separate = bool(heads) and not all(
        head_names(r) == heads and _labels(r) == _labels(r0) and all(r.shape(n) == r0.shape(n) for n in heads)
        for r in readers[1:]
    )
    _check_bodies(readers, separate)
    check_same_vocabulary([r.path for r in readers], "a merged model reads text with the first model's tokenizer")
    if base_reader is not None:
        _check_base(base_reader, r0, heads)
    _warn_mixed_dtypes(readers, written)
    for fisher, r in zip(files.get("fisher") or [], readers, strict=False):
        _check_fisher(fisher, r)
    if refit is not None or merger.needs_data:  # their forward passes run the models before any tensor is merged
        for r in readers:
            check_finite(r.tensor_files.values())  # a NaN was found after the data pass, and blamed on the output
    refit_data = None
    if refit is not None:  # a model without a head, or bad data: refused now, not after the merge
        for r in readers:
            check_refittable(r.path, r.config, {n: r.shape(n) for n in head_names(r)})
        refit_data = refit_batches([r.path for r in readers], refit)
    merger.prepare([r.path for r in readers], frozenset(heads) if separate else frozenset())  # e.g. RegMean++
    same_input: dict[str, str] = {}
    if (grams := files.get("gram")) is not None:
        pairs = [g.same_input for g in grams]
        same_input = {k: v for k, v in pairs[0].items() if all(p.get(k) == v for p in pairs[1:])}
    merger.pool = BufferPool() if dev.type == "cpu" else None  # reused read buffers: no page faults per tensor
    merger.device = dev
    weights = merger.model_weights(len(readers))
    names = _head_folders(models, files, model_names)
    return MergePlan(strategy, Path(out), merger, readers, base_reader, files, weights, heads, union, separate, names,
                     refit, refit_data, same_input, dev, written)  # fmt: skip


def _finish_heads(plan: MergePlan, tmp: Path) -> tuple[str, dict | None]:
    """After the body: the union label space, the per-model head folders, the head refit; ``(policy, refit)``."""
    if plan.union is not None:  # the merged head learned every class some model learned
        write_label_space(tmp, plan.union.merged())
    if plan.separate:
        merged = StreamingReader(tmp)
        for rel, r in zip(plan.names.values(), plan.readers, strict=True):
            if rel != ".":
                write_checkpoint(r, tmp / rel, replace=lambda n, t, r=r: t if n in head_names(r) else merged.get(n),
                                 shard_bytes=SHARD_BYTES, dtype=plan.out_dtype)  # fmt: skip
    policy = "union" if plan.union is not None else ("per-dataset" if plan.separate else "merged")
    refitted = None
    if plan.refit is not None and plan.refit_data is not None:
        folders = plan.names if plan.separate else dict.fromkeys(plan.names, ".")
        refitted = refit_heads(tmp, folders, [r.path for r in plan.readers], plan.refit_data, plan.refit.ridge,
                               plan.learned, plan.refit.device)  # fmt: skip
    return policy, refitted


def _write_report(
    plan: MergePlan, tmp: Path, policy: str, refitted: dict | None, models, stats, base, card, start
) -> dict:
    """``symfuse_report.json`` and the ``README.md`` model card of the merged folder.

    ``card["inputs"]``: where a reader finds the inputs, in order (the models as the user gave them where the merge
    read aligned copies of them; a pipeline's store URIs where it read local copies).
    """
    card = dict(card or {})
    shown = [str(m) for m in (card.get("inputs") or models)]
    report = {
        "strategy": plan.strategy,
        "params": plan.merger.params.model_dump(by_alias=True),
        "models": shown,
        **({"aligned": list(card["symmetries"])} if card.get("inputs") and card.get("symmetries") else {}),
        "stats": [str(s) for s in stats or []],
        "base": str(base) if base is not None else None,
        "device": str(plan.device),
        **({"dtype": str(plan.out_dtype).removeprefix("torch.")} if plan.out_dtype is not None else {}),
        "heads": {
            "policy": policy,
            "folders": plan.names if plan.separate else {},
            **({"learners": plan.union.learners()} if plan.union is not None else {}),
            **({"refit": refitted} if refitted is not None else {}),
        },
        "counters": plan.merger.counters,
        "seconds": round(time.perf_counter() - start, 3),
    }
    (tmp / REPORT).write_text(json.dumps(report, indent=2))
    inputs = [  # fine-tuning metrics from the given folder when it is one here, else from the copy merged
        {"name": name, "dataset": name, "path": path, "metrics": input_metrics(path if Path(path).is_dir() else m)}
        for name, path, m in zip(plan.names, shown, models, strict=True)
    ]
    text = model_card(
        plan.strategy, report["params"], inputs, json.loads((tmp / "config.json").read_text()),
        base=card.get("base_model") or (str(base) if base is not None else None),
        symmetries=card.get("symmetries") or (), heads=policy, extra=card.get("extra"),
        head_refit=plan.refit.ridge if plan.refit is not None else None,
    )  # fmt: skip
    (tmp / CARD).write_text(text)
    return report


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
    model_names: Sequence[str] | None = None,
    out_dtype: str | torch.dtype | None = None,
    on_progress: Callable[[float], None] | None = None,
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
            none), ``inputs`` (where a reader finds each model, in order: the folders given before alignment, or store
            URIs; default ``models``), ``extra`` (more front-matter facts, e.g. the run id).
        head_refit: Refit every task head to the merged body on each model's own data
            (:mod:`symfuse.merge.head_refit`; its ``data`` is loaded before the merge starts), recorded under the
            report's ``heads.refit``; None: heads as merged.
        device: Where the merge's maths runs (``cpu``, ``cuda``, ``cuda:N``, ``auto``). Off the CPU, one tensor of
            the K models (with its statistics) is on the device at a time, merged with whole-tensor torch ops,
            and written from host memory.
        model_names: One name per model for its head folder (``heads/<name>``) and the report; None: the dataset each
            model was trained on (its statistics' or ``symfuse_train.json``'s), else its folder name.
        out_dtype: Write the merged floating tensors in this dtype (``float32``, ``float16``, ``bfloat16``,
            ``float64``; ``config.json`` says so); None: in the first model's. The maths accumulates in float32 (or
            float64) either way; integer tensors are copied as they are.
        on_progress: Called with the fraction of the elements merged (0..1] after every tensor; it may raise to stop
            the merge (nothing is written then).
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
    check_output(out, overwrite, inputs=[*models, *(stats or ()), base])
    plan = plan_merge(strategy, models, out, stats, base, head_refit, device, params, model_names, out_dtype)
    out = Path(out)
    with atomic_output_dir(out, overwrite=overwrite) as tmp:
        try:
            with parallel_reads():  # the merge's reads run between its BLAS calls: the cores are free
                merge = TensorMerge(plan, on_progress)
                write_checkpoint(plan.readers[0], tmp, replace=merge, shard_bytes=SHARD_BYTES, overwrite=True,
                                 dtype=plan.out_dtype)  # fmt: skip
            merge.check_fishers()
        finally:
            plan.merger.close()
        if plan.readers[0].aliases:  # model 0 ties its LM head, another stores its own: the merge stores one
            update_config_json(tmp, {"tie_word_embeddings": False})
        policy, refitted = _finish_heads(plan, tmp)
        report = _write_report(plan, tmp, policy, refitted, models, stats, base, card, start)
    log.info("merged %d models with %s into %s in %.1f s", len(plan.readers), strategy, out, report["seconds"])
    return out
