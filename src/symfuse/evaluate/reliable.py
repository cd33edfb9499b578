"""Which of a merged model's per-dataset heads to trust on a dataset none of them was trained on.

A merge of models with different label sets keeps one body and one head per dataset. Out of domain the heads can vote
(:mod:`symfuse.evaluate.ensemble`), or the most reliable head can answer alone. A head's reliability is measured on
data it may see: its OWN dataset's validation split, scored exactly as the out-of-domain set will be scored: over the
classes it shares with that set, predicting among those classes only (out-of-domain scoring of
:func:`symfuse.evaluate.scoring.score_logits`). This compares heads with different numbers of classes on the task
they will be asked to do, and reads no label of the out-of-domain set. When the set is scored over a fixed class set
(``scored``: the classes it shares with the union of the training sets) a head lacking some of them is rated lower in
proportion: its rating is the mean F1 over the classes it has times the share of the scored classes it has, i.e.
the macro-F1 over the scored classes if each missing class scores 0 (as it does on the set).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from symfuse.data import load_task_dataset
from symfuse.data.dataset import DatasetError, TaskDataset
from symfuse.data.labels import shared_label_names
from symfuse.evaluate.ensemble import _heads_logits
from symfuse.evaluate.scoring import score_logits

log = logging.getLogger(__name__)


def require_rating_split(ds: TaskDataset, split: str = "validation") -> None:
    """Raise if ``ds`` has no ``split`` to rate its head on (checked before any heavy work, and by :func:`rate_heads`).

    Raises:
        DatasetError: naming the dataset and the fix.
    """
    if split not in ds.splits:
        raise DatasetError(f"{ds.name}: no {split} split to rate its head on — add {split}.jsonl, or use "
                           f"evaluation.ood_heads: vote")  # fmt: skip


def rate_heads(
    heads: Mapping[str, str | Path],
    data: Mapping[str, str],
    target_labels: Sequence[str],
    split: str = "validation",
    max_examples: int | None = None,
    device: str = "cpu",
    batch_size: int = 64,
    max_length: int = 128,
    seed: int = 13,
    scored: Sequence[str] | None = None,
    on_progress: Callable[[float], None] | None = None,
) -> dict[str, float]:
    """Each head's score on its own dataset's ``split``, over the classes it shares with ``target_labels``.

    Args:
        heads: Dataset name -> checkpoint folder of the head trained on it (a merged model's sub-folder).
        data: Dataset name -> its source (see :func:`symfuse.data.load_task_dataset`).
        target_labels: The class names of the set the heads will be asked about.
        split: The split rated on (``validation``: never the test split the model is reported on).
        max_examples: Seeded random subset of each split.
        device: ``cpu`` or ``cuda[:i]``.
        batch_size: Evaluation batch size.
        max_length: Truncation length in tokens.
        seed: Seed of the subsets.
        scored: The classes the set is scored over (see the module docstring); None: each head's own shared ones.
        on_progress: Called with the fraction of the heads rated (0..1) after every batch (it may raise to stop).

    Returns:
        Dataset name -> the primary metric (e.g. macro-F1) of its head, for every head sharing a class with
        ``target_labels``, in ``heads``' order.

    Raises:
        DatasetError: a dataset has no ``split``, or a head is not a classifier (the message names it).
    """
    how = dict(split=split, max_examples=max_examples, device=device, batch_size=batch_size, max_length=max_length,
               seed=seed)  # fmt: skip
    scores: dict[str, float] = {}
    for k, (name, folder) in enumerate(heads.items()):
        ds = load_task_dataset(data[name])
        require_rating_split(ds, split)
        if on_progress is not None:
            how["on_progress"] = lambda f, k=k: on_progress((k + f) / len(heads))
        rated, logits, gold = _heads_logits([folder], ds, how)
        if not rated:
            continue
        classes = shared_label_names(target_labels, rated[0].names)
        if scored:
            classes = shared_label_names(classes, scored, restrict=None)
        if not classes:
            continue
        own = shared_label_names(ds.labels, classes, restrict=None)  # the same classes in the dataset's spelling
        # one class per example among ``own`` (argmax of the head's logits over them), as on the out-of-domain set
        metrics = score_logits(ds, rated[0].names, "single_label_classification", [logits[0]], [gold],
                               in_domain=False, scored=own)  # fmt: skip
        coverage = len(classes) / len(scored) if scored else 1.0
        scores[name] = float(metrics[metrics["primary"]]) * coverage
        log.info("head %s on %s/%s over %d shared classes: %s = %.4f (rating %.4f)", name, ds.name, split, len(own),
                 metrics["primary"], metrics[metrics["primary"]], scores[name])  # fmt: skip
    return scores


def most_reliable(scores: Mapping[str, float]) -> str:
    """The best-rated head (ties: the first); ``scores`` from :func:`rate_heads`, not empty."""
    return max(scores, key=scores.__getitem__)
