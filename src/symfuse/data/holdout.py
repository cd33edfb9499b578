"""Where a fine-tune picks its best epoch: the validation split, else a seeded slice held out of train, never test.

:func:`epoch_selection` splits a :class:`~symfuse.data.dataset.TaskDataset` into the records a fine-tune trains on and
the records each epoch is scored on:

* the dataset has a validation split: train as it is, scored on validation;
* no validation split (``train.jsonl`` + ``test.jsonl`` only, ``train=a.csv,test=b.csv``, a hub dataset without
  one), or a validation split read from the train file (a single data file serves every split):
  :data:`HOLDOUT_FRACTION` of the train records (at least one), drawn with the fine-tune's seed and stratified by
  label for single-label classification, are held out of training and score the epochs; the rest trains. The test
  split is never read: the epoch kept must not be chosen on the data the model is reported on;
* no validation split and fewer than :data:`MIN_HOLDOUT_TRAIN` train records: nothing to hold out, no epoch is
  scored and the last one is kept.

The slice depends only on the train records as loaded and the seed: ``max_train_examples`` caps the train split
first (:func:`~symfuse.data.load_task_dataset`), and the slice is then held out of those capped records, so a fine-tune
reads at most ``max_train_examples`` train records in all and trains on that many less the slice.
"""

from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass, replace
from typing import Any

from symfuse.data.batches import encode_split
from symfuse.data.dataset import TaskDataset

log = logging.getLogger(__name__)

HOLDOUT_FRACTION = 0.1  # of the train records, held out to score epochs when there is no validation split
MIN_HOLDOUT_TRAIN = 2  # fewer train records: nothing is held out (one must train), the last epoch is kept
HOLDOUT_SPLIT = "train_holdout"  # the name epoch records give the held-out slice


@dataclass(frozen=True)
class EpochSelection:
    """The records a fine-tune trains on and those it scores each epoch on.

    Attributes:
        train: The records trained on (a ``datasets.Dataset``).
        scored: The records each epoch is scored on; None when there are none (the last epoch is kept).
        split: ``validation``, :data:`HOLDOUT_SPLIT` (a slice held out of train) or None (nothing scored).
        held_out: Train records held out of training (0 unless ``split`` is :data:`HOLDOUT_SPLIT`).
        stratified: Whether the held-out slice was drawn per label (single-label classification).
    """

    train: Any
    scored: Any | None
    split: str | None
    held_out: int = 0
    stratified: bool = False

    @property
    def splits(self) -> dict[str, Any]:
        """``{"train": train, split: scored}`` (no test split): what a fine-tune reads."""
        return {"train": self.train, **({self.split: self.scored} if self.split else {})}

    def to_json(self, max_examples: int | None = None) -> dict[str, Any]:
        """The record ``symfuse_train.json`` keeps (``max_examples``: the cap on the records scored per epoch)."""
        n = 0 if self.scored is None else len(self.scored)
        return {
            "split": self.split,
            "examples": n if max_examples is None else min(n, max_examples),
            "held_out_of_train": self.held_out,
            "train_examples": len(self.train),
            **({"fraction": HOLDOUT_FRACTION, "stratified": self.stratified} if self.split == HOLDOUT_SPLIT else {}),
        }

    def describe(self, name: str, seed: int) -> str | None:
        """One line saying where the epochs are scored when it is not the validation split, else None."""
        if self.split == "validation":
            return None
        total = len(self.train) + self.held_out
        if self.split is None:
            return (
                f"{name}: no validation split and {total} train record(s), too few to hold any out — no epoch is "
                "scored and the last one is kept (the test split is never used to choose it)"
            )
        how = ", stratified by label" if self.stratified else ""
        return (
            f"{name}: no validation split — {self.held_out} of {total} train records ({HOLDOUT_FRACTION:.0%}, "
            f"seed {seed}{how}) are held out of training to pick the best epoch; the test split is not read"
        )


def holdout_indices(
    n: int, seed: int, strata: list[str] | None = None, fraction: float = HOLDOUT_FRACTION
) -> list[int]:
    """The sorted indices of the records held out of ``n`` train records (empty below :data:`MIN_HOLDOUT_TRAIN`).

    ``max(1, floor(n * fraction))`` records, drawn with ``random.Random(seed)``. With ``strata`` (one label per
    record) each label gets its share of them by largest remainder, and a label is emptied of its last train record
    only when no other label can give one.

    Args:
        n: Train records.
        seed: Seed of the draw.
        strata: The label of each record, or None for a plain random draw.
        fraction: Share of the records to hold out.

    Returns:
        Indices into ``range(n)``, ascending.
    """
    if n < MIN_HOLDOUT_TRAIN:
        return []
    k = min(n - 1, max(1, int(n * fraction)))
    rng = random.Random(seed)
    if strata is None:
        return sorted(rng.sample(range(n), k))
    groups: dict[str, list[int]] = {}
    for i, label in enumerate(strata):
        groups.setdefault(label, []).append(i)
    for label in sorted(groups):
        rng.shuffle(groups[label])
    exact = {label: k * len(members) / n for label, members in groups.items()}
    quota = {label: int(share) for label, share in exact.items()}
    order = sorted(groups, key=lambda c: (quota[c] + 1 >= len(groups[c]), quota[c] - exact[c], c))
    for label in order[: k - sum(quota.values())]:
        quota[label] += 1
    return sorted(i for label in sorted(groups) for i in groups[label][: quota[label]])


def epoch_selection(data: TaskDataset, seed: int) -> EpochSelection:
    """Split ``data`` into the records a fine-tune trains on and those that score its epochs (see the module).

    Args:
        data: The loaded task (after any ``max_train_examples`` cap).
        seed: The fine-tune's seed (draws the held-out slice).

    Returns:
        The :class:`EpochSelection`; its records never come from the test split.
    """
    train = data.split("train")
    if "validation" in data.splits and not _same_file(data.files, "validation", "train"):
        return EpochSelection(train, data.splits["validation"], "validation")
    stratify = data.task in ("classification", "pair_classification") and not data.multi_label
    held = holdout_indices(len(train), seed, [str(x) for x in train["label"]] if stratify else None)
    if not held:
        return EpochSelection(train, None, None)
    keep = sorted(set(range(len(train))) - set(held))
    return EpochSelection(train.select(keep), train.select(held), HOLDOUT_SPLIT, len(held), stratify)


def _same_file(files: dict[str, Any], a: str, b: str) -> bool:
    """Whether splits ``a`` and ``b`` are read from one local file (a single ``--data`` file serves every split)."""
    return a in files and b in files and os.path.realpath(files[a]) == os.path.realpath(files[b])


def selection_features(
    data: TaskDataset, tokenizer: Any, max_length: int, seed: int, max_examples: int | None = None
) -> tuple[EpochSelection, list[dict[str, Any]], list[dict[str, Any]]]:
    """:func:`epoch_selection` (said in one log line unless it is the validation split) and both sides encoded.

    Args:
        data: The loaded task.
        tokenizer: A tokenizer (see :func:`~symfuse.data.encode_split`).
        max_length: Truncation length in tokens.
        seed: The fine-tune's seed (the held-out slice, and the subset of ``max_examples``).
        max_examples: Seeded subset of the records scored per epoch.

    Returns:
        ``(selection, train features, scored features)``; the scored ones are empty when nothing is scored.
    """
    selection = epoch_selection(data, seed)
    if (line := selection.describe(data.name, seed)) is not None:
        log.log(logging.INFO if selection.split else logging.WARNING, "%s", line)
    view = replace(data, splits=selection.splits)
    train = encode_split(view, tokenizer, "train", max_length)
    scored = encode_split(view, tokenizer, selection.split, max_length, max_examples, seed) if selection.split else []
    return selection, train, scored
