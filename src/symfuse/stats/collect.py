"""``collect_stats``: load a checkpoint and a dataset, collect Gram and/or Fisher, write one file per kind."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from symfuse.checkpoint import load_hf_model, validate_checkpoint
from symfuse.data.batches import load_tokenizer, name_padding, tracked_batches
from symfuse.data.labels import LABEL_SPACE_KEY, head_targets, is_causal_lm, union_columns
from symfuse.errors import DataError, overflowed
from symfuse.io import fsync_dir, plain_mode
from symfuse.stats.fisher import collect_fisher
from symfuse.stats.gram import collect_gram
from symfuse.stats.io import STAT_KINDS, StatsFile, save_stats
from symfuse.stats.ownership import model_fingerprint, same_model

log = logging.getLogger(__name__)

GRAM_DTYPES = ("float64", "float32")  # how Grams are stored (always accumulated in float64)


def load_model(model: str | os.PathLike) -> nn.Module:
    """Load a checkpoint folder with the head class named in its config (``architectures``), in eval mode."""
    return load_hf_model(model)


def check_fisher_targets(config: Any, ds: Any, where: object) -> list[str] | None:
    """The label space the empirical Fisher's targets index: the head's classes matched by name, or a refusal.

    The empirical Fisher takes each example's class as the target of the head's output OF THAT NAME (matched
    case-insensitively, as evaluation and the loss barrier do; :func:`~symfuse.data.labels.target_space`).

    Args:
        config: The model's config (its head's ``id2label``).
        ds: The :class:`~symfuse.data.TaskDataset` (``source``, ``task``, ``labels``).
        where: The model, for the message.

    Returns:
        The head's classes in output order, or None: the dataset's own order (no head names, regression).

    Raises:
        DataError: a class of the data missing from a named head, or more classes than an unnamed head has outputs.
    """
    fix = "give the data the model was trained on, or use --fisher-mode sampled (targets drawn from the model)"
    return head_targets(config, ds, where, fix)


def _check_fisher_head(config: Any, ds: Any, where: object, mode: str) -> None:
    """Refuse a Fisher the head cannot give on ``ds``: a causal LM's (no task head), or targets of the other kind.

    A language model's next-token logits met per-example class ids deep in the pass (a shape error); single-label
    targets on a multi-label head, or multi-hot ones on a single-label head, are not the head's likelihood.
    """
    if is_causal_lm(config):
        raise DataError(f"{where}: a causal language model has no task head to take the Fisher of on {ds.name} — "
                        "collect --kind gram, or the Fisher of a fine-tuned classifier")  # fmt: skip
    head_multi = getattr(config, "problem_type", None) == "multi_label_classification"
    union = getattr(config, LABEL_SPACE_KEY, None) is not None  # binary outputs over the union's classes, by design
    if mode == "empirical" and ds.task == "classification" and head_multi != ds.multi_label and not union:
        kinds = ("single-label", "multi-label")
        raise DataError(f"{where}: a {kinds[head_multi]} head, and {ds.name} is {kinds[ds.multi_label]}: its "
                        "targets are not the head's likelihood — give data of the head's kind, or use "
                        "--fisher-mode sampled (targets drawn from the model)")  # fmt: skip


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
    gram_dtype: str = "float64",
) -> dict[str, Path]:
    """Collect statistics of a checkpoint on a dataset and write ``<out_dir>/<kind>.safetensors``.

    The folder is written as one unit: every kind is collected into a temporary folder next to ``out_dir``,
    which is then renamed into place (or, when ``out_dir`` exists, whose files replace their namesakes), so a
    failed run leaves the previous folder intact and a half-written file is never readable.

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
        progress: Show progress bars when stderr is a terminal.
        on_progress: Called with the fraction done (0..1] after every batch of every kind.
        gram_dtype: How the Grams are stored (:data:`GRAM_DTYPES`; accumulated in float64 either way).
            ``float32`` halves the file and what a float32 RegMean merge reads, at a relative rounding of
            ~6e-8 per entry (below a float32 solve's own); keep ``float64`` for float64 merges.

    Returns:
        ``{kind: file}``.

    Raises:
        ValueError: on an unknown kind or Gram dtype.
        CheckpointError: a bad checkpoint (``NonFiniteError`` for NaN / inf weights), before any work.
        TokenizerError: the checkpoint folder has no tokenizer.
    """
    from symfuse.data import load_task_dataset, make_batches

    unknown = [k for k in kinds if k not in STAT_KINDS]
    if unknown:
        raise ValueError(f"unknown statistics kind(s) {unknown}; choose from {list(STAT_KINDS)}")
    if gram_dtype not in GRAM_DTYPES:
        raise ValueError(f"unknown Gram dtype {gram_dtype!r}; choose from {list(GRAM_DTYPES)}")
    folder = validate_checkpoint(model, finite=True, tokenizer=True)
    net = load_hf_model(folder, validate=False)
    tok = load_tokenizer(folder, net.config)
    name_padding(net, tok)  # the id the batches pad with (a decoder's classifier finds each row's end by it)
    ds = load_task_dataset(data)
    # refused before any pass: a union head without the data's classes, or classes the head does not have
    space = None
    if "fisher" in kinds:
        _check_fisher_head(net.config, ds, folder, fisher_mode)
    if "fisher" in kinds and union_columns(net.config, ds, folder) is None and fisher_mode == "empirical":
        space = check_fisher_targets(net.config, ds, folder)
    batches = make_batches(ds, tok, split, batch_size, max_length, max_examples, seed, space=space, config=net.config)
    common: dict[str, Any] = {
        "model": str(folder),
        "dataset": ds.name,
        "split": split,
        "model_fingerprint": model_fingerprint(folder),
        "dataset_fingerprint": f"{ds.fingerprint}:{split}:{max_examples}:{max_length}:{seed}",
    }
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        _collect_into(
            tmp, net, batches, kinds, common, ds, device, fisher_mode, seed, progress, on_progress, gram_dtype
        )
        _move_in(tmp, out_dir, folder, common["model_fingerprint"])
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    written = {kind: out_dir / f"{kind}.safetensors" for kind in kinds}
    for kind, file in written.items():  # debug: a caller writing through a temporary folder names the final one
        log.debug("wrote %s statistics %s", kind, file)
    del net
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return written


def _collect_into(
    out_dir: Path,
    net: nn.Module,
    batches: list,
    kinds: Sequence[str],
    common: dict[str, Any],
    ds: Any,
    device: str,
    fisher_mode: str,
    seed: int,
    progress: bool,
    on_progress: Callable[[float], None] | None,
    gram_dtype: str = "float64",
) -> None:
    """Collect each kind and write ``out_dir/<kind>.safetensors`` (Grams stored in ``gram_dtype``)."""
    for i, kind in enumerate(kinds):
        share = 1 / len(kinds)
        stream = tracked_batches(batches, len(batches), f"{kind} statistics", on_progress, i * share, share, log)
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
            stored = getattr(torch, gram_dtype)
            grams = _finite({k: v.to(stored) for k, v in g.grams.items()}, "gram", common["model"])
            save_stats(grams, out_dir / "gram.safetensors", meta)
        else:
            f = collect_fisher(
                net,
                stream,
                mode=fisher_mode,
                seed=seed,
                device=device,
                progress=progress,
                columns=union_columns(net.config, ds, common["model"]),  # a union head: its own classes
            )  # type: ignore[arg-type]
            meta = {
                **common,
                "kind": "fisher",
                "n_tokens": str(f.n_tokens),
                "n_examples": str(f.n_examples),
                "fisher_mode": f.mode,
            }
            fisher = _finite({k: v.float() for k, v in f.fisher.items()}, "Fisher", common["model"])
            save_stats(fisher, out_dir / "fisher.safetensors", meta)


def _finite(stats: dict[str, torch.Tensor], kind: str, model: str) -> dict[str, torch.Tensor]:
    """``stats``, or the error naming the first that holds NaN / inf (nothing is written then)."""
    for key, value in stats.items():
        if not bool(torch.isfinite(value).all()):
            raise overflowed(model, f"its {kind} of {key} on this data")
    return stats


def _move_in(tmp: Path, out: Path, model: Path, fingerprint: str) -> None:
    """Put the finished files of ``tmp`` in place: rename the whole folder, or (``out`` exists) file by file.

    Nothing is moved until every kind is collected, so a failed run leaves the previous folder intact. Other
    files of an existing ``out`` are kept; a stats file there of ANOTHER model gets a warning (the merge refuses
    the mixed folder until it is recollected).
    """
    fsync_dir(tmp)
    if not out.exists():
        plain_mode(tmp)  # mkdtemp made it 0700
        os.replace(tmp, out)
    else:
        new = {f.name for f in tmp.iterdir()}
        for f in out.iterdir():
            if f.name in new or f.suffix != ".safetensors" or f.stem not in STAT_KINDS:
                continue
            try:
                other = StatsFile(f).meta.get("model_fingerprint")
            except Exception:  # unreadable: kept as it was, the merge reports it
                other = None
            if other and not same_model(model, str(other), fingerprint):
                log.warning("%s: belongs to another model (%s); recollect it with this model's statistics", f, other)
        for name in sorted(new):
            os.replace(tmp / name, out / name)
    fsync_dir(out)
    fsync_dir(out.parent)
