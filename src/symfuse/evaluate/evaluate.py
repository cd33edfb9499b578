"""Evaluate a checkpoint with a task head on a dataset split; write the metrics JSON."""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from symfuse.checkpoint import resolve_checkpoint
from symfuse.data import iter_batches, load_task_dataset, tracked_batches
from symfuse.data.batches import encode_split, padding_id, readable_length
from symfuse.data.files import NER_SCHEME, not_a_ner_tag
from symfuse.data.labels import label_index, read_label_space, same_names, short_names, unnamed
from symfuse.data.text import is_language_modeling, text_dataset_name, text_split
from symfuse.device import resolve_device
from symfuse.errors import CheckpointError, overflowed
from symfuse.evaluate.predict import head_label_names, head_problem_type, load_task_model, mean_loss, run_model
from symfuse.evaluate.scoring import check_shared_classes, score_logits
from symfuse.io import plain_mode

log = logging.getLogger(__name__)


def write_json_atomic(data: Any, file: Path) -> Path:
    """Write JSON to ``file`` through a temporary file and a rename."""
    file = Path(file)
    file.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{file.name}.", dir=file.parent)
    with os.fdopen(fd, "w") as fh:
        json.dump(data, fh, indent=2)
    plain_mode(tmp)  # mkstemp made it 0600
    os.replace(tmp, file)
    return file


def evaluate_model(
    model: str | Path,
    data: str,
    split: str = "test",
    labels_from: str | None = None,
    max_examples: int | None = None,
    device: str = "cpu",
    batch_size: int = 64,
    max_length: int = 128,
    seed: int = 13,
    out_file: Path | None = None,
    on_progress: Callable[[float], None] | None = None,
    in_domain: bool | None = None,
    scored: list[str] | None = None,
) -> dict:
    """Metrics of a task model on a dataset split (a causal LM's perplexity on language-modelling data), as JSON.

    Classes are matched by name between the head (``config.id2label``, or the labels of ``labels_from``) and the
    dataset; out-of-domain emotion data is scored over the shared classes only (rule in
    :mod:`symfuse.evaluate.scoring`). A union head (label metadata in ``config.json``, see
    :class:`symfuse.data.labels.LabelSpace`) scores the datasets it learned from in-domain, and never predicts a
    class no training set had.

    A language-modelling dataset (``"task": "language_modeling"`` in its ``meta.json``) is scored by
    :func:`symfuse.evaluate.language.evaluate_language_model`: ``loss`` (mean next-token NLL) and ``perplexity``.

    Args:
        model: Checkpoint folder with a sequence- or token-classification head (a causal LM for language modelling).
        data: Dataset source (see :func:`symfuse.data.load_task_dataset`).
        split: ``test`` | ``validation`` | ``train``.
        labels_from: Dataset whose label list names the head's outputs (for heads saved without names).
        max_examples: Seeded random subset of the split.
        device: ``cpu`` or ``cuda[:i]``.
        batch_size: Evaluation batch size.
        max_length: Truncation length in tokens.
        seed: Seed of the subset.
        out_file: Where to write the JSON (default ``<model>/eval_<dataset>_<split>.json``).
        on_progress: Called with the fraction of batches done (0..1] after every batch.
        in_domain: False: the model never trained on this dataset, score it out of domain (shared classes) even when
            the label sets are equal (meld's head on goemotions_ekman); None: in domain iff the head's classes are
            the dataset's (a union head: iff it learned from this dataset).
        scored: Out of domain: the classes to score, whatever the head has (see
            :func:`symfuse.evaluate.scoring.score_logits`); None: those the head shares with the dataset.

    Returns:
        The metrics (``macro_f1`` / ``f1`` / ``accuracy`` / ``matthews`` / ``pearson`` ... per task, ``loss`` when the
        label spaces are identical, ``primary``, ``n``, ``seconds`` and the settings).
    """
    if is_language_modeling(str(data)):
        return _evaluate_lm(model, str(data), split, max_examples, device, batch_size, max_length, seed, out_file,
                            on_progress)  # fmt: skip
    t0 = time.perf_counter()
    path = resolve_checkpoint(model)
    net, tok = load_task_model(path, device)  # validates the folder (values, tokenizer) before the data is read
    ds = load_task_dataset(data)
    head_problem = head_problem_type(net.config)
    head_labels = _output_names(path, head_label_names(net.config), labels_from)
    if (head_problem == "token_classification") != ds.is_token_task:
        raise ValueError(f"{path}: a {head_problem} head cannot be evaluated on {ds.name} ({ds.problem_type})")
    if head_problem == "token_classification" and (tag := not_a_ner_tag(head_labels)) is not None:
        fix = "give --labels-from the data the model was trained on" if unnamed(head_labels) else "rename them"
        raise CheckpointError(f"{path}/config.json (id2label): the head's tag {tag!r} {NER_SCHEME} ({fix})")
    if ds.problem_type not in ("regression", "token_classification"):
        check_shared_classes(ds, head_labels)  # before the model runs over the split
    max_length = readable_length(max_length, net.config, path)  # recorded as used: longer texts are cut there
    feats = encode_split(ds, tok, split, max_length, max_examples, seed)
    batches = iter_batches(feats, batch_size, padding_id(tok, net.config), by_length=True)  # metrics: order-free
    total = math.ceil(len(feats) / batch_size)
    batches = tracked_batches(batches, total, f"evaluate on {ds.name}/{split}", on_progress, logger=log)
    dev = resolve_device(device)
    same_space = head_labels == ds.labels and head_problem == ds.problem_type
    loss_problem = ds.problem_type if same_space or ds.problem_type == "regression" else None
    logits, labels, loss = run_model(net, batches, loss_problem, dev, amp=dev.type == "cuda")
    if not all(bool(torch.isfinite(z).all()) for z in logits):  # metrics of NaN logits would be argmax-of-NaN
        raise overflowed(path, f"its outputs on {ds.name}/{split}")
    space = read_label_space(net.config, path) if labels_from is None else None
    if space is not None:  # union head: in-domain iff it learned from this dataset; unlearned classes never predicted
        in_domain = in_domain is not False and space.covers(ds.name, ds.labels)
        never = [i for i, ok in enumerate(space.learned) if not ok]
        logits = [z.index_fill(1, torch.tensor(never, dtype=torch.long), float("-inf")) for z in logits]
    metrics = score_logits(ds, head_labels, head_problem, logits, labels, in_domain=in_domain, scored=scored)
    if same_space or ds.problem_type == "regression":
        metrics["loss"] = loss
    elif space is None and head_problem == ds.problem_type and (order := _by_name(head_labels, ds.labels)):
        metrics["loss"] = mean_loss([z[:, order] for z in logits], labels, ds.problem_type)  # same classes, renamed
    metrics.update(
        {
            "model": str(model),
            "data": str(data),
            "dataset": ds.name,
            "split": split,
            "labels_from": labels_from,
            "head_labels": head_labels,
            "max_examples": max_examples,
            "max_length": max_length,
            "data_fingerprint": ds.fingerprint,
            "seconds": time.perf_counter() - t0,
        }
    )
    out_file = Path(out_file) if out_file else path / f"eval_{ds.name}_{split}.json"
    write_json_atomic(metrics, out_file)
    metrics["metrics_file"] = str(out_file)
    log.info(
        "%s on %s/%s: %s = %.4f (n=%d)",
        path,
        ds.name,
        split,
        metrics["primary"],
        metrics[metrics["primary"]],
        metrics["n"],
    )
    return metrics


def _output_names(path: Path, head: list[str], labels_from: str | None) -> list[str]:
    """The head's class names: its ``id2label``, or those of ``--labels-from`` for a head without names.

    Raises:
        CheckpointError: ``--labels-from`` would rename a head's named outputs by position (another set or order).
        ValueError: ``--labels-from`` has another number of classes than the head has outputs.
    """
    if labels_from is None:
        return head
    names = load_task_dataset(labels_from).labels
    if len(names) != len(head):
        raise ValueError(f"{path}: head has {len(head)} outputs but {labels_from} has {len(names)} labels — give "
                         "--labels-from the dataset the head was trained on")  # fmt: skip
    if not unnamed(head) and not same_names(head, names):
        raise CheckpointError(
            f"{path}/config.json: the head already names its outputs ({short_names(head)}); --labels-from "
            f"{labels_from} would rename them by position ({short_names(names)}) — drop --labels-from: named "
            "classes are matched by name"
        )
    return names


def _evaluate_lm(
    model: str | Path,
    data: str,
    split: str,
    max_examples: int | None,
    device: str,
    batch_size: int,
    max_length: int,
    seed: int,
    out_file: Path | None,
    on_progress: Callable[[float], None] | None,
) -> dict:
    """:func:`evaluate_model` on a language-modelling dataset: the causal LM's loss and perplexity, as JSON."""
    from symfuse.evaluate.language import evaluate_language_model

    path = resolve_checkpoint(model)
    texts = text_split(data, split, max_examples, seed)
    metrics = evaluate_language_model(str(path), texts, resolve_device(device), batch_size, max_length, on_progress)
    name = text_dataset_name(data)
    metrics.update({"model": str(model), "data": data, "dataset": name, "split": split, "max_examples": max_examples,
                    "max_length": max_length})  # fmt: skip
    out_file = Path(out_file) if out_file else path / f"eval_{name}_{split}.json"
    write_json_atomic(metrics, out_file)
    metrics["metrics_file"] = str(out_file)
    log.info("%s on %s/%s: perplexity = %.4g (%d tokens)", path, name, split, metrics["perplexity"], metrics["tokens"])
    return metrics


def _by_name(head: Sequence[str], data: Sequence[str]) -> list[int] | None:
    """The head's output of each of the data's classes, when both name the same classes (in any order or case)."""
    on_head, on_data = label_index(head), label_index(data)
    if not len(on_head) == len(head) == len(data) == len(on_data) or on_head.keys() != on_data.keys():
        return None
    return [on_head[k] for k in on_data]
