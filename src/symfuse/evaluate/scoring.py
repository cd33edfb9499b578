"""Turn a head's logits into dataset metrics, mapping the head's label space onto the dataset's by NAME.

Label-space rule (in-domain and out-of-domain alike):

* The head's classes are ``config.id2label`` (or the labels of ``--labels-from``); the dataset's come from its
  ``meta.json``. Classes are matched by name, never by id.
* Same class set (in-domain): every class is scored (ids may be in any order).
* Union heads (one binary output per class of every training set's labels): the dataset is in-domain when the
  head learned from it (the caller says so, from the checkpoint's label metadata); all its classes are scored.
* In-domain single-label data gets one predicted class per example (argmax over the dataset's classes, whatever the
  head's problem type), and Matthews' correlation besides the F1s.
* Different sets (out-of-domain emotion): only the shared classes are scored — the six Ekman emotions (anger,
  disgust, fear, joy, sadness, surprise) that both sides have. Every head predicts ONE class per example there
  (argmax over the shared classes' logits), a multi-label union head as well as a single-label one: its binary
  classifiers were each trained on single-label data and scored alike, so per-dataset and union heads are compared
  on one rule (a threshold at 0.5 would score a cautious union head at zero on a set where no class is sure). Gold
  is restricted to the shared classes too: single-label examples whose gold class is not shared are dropped,
  multi-label examples keep only their shared labels (a prediction is right when it is one of them) and are dropped
  when none is left. Macro-F1 is the mean F1 of the shared classes that occur in gold or predictions.
* ``scored`` (out of domain): score a FIXED class set instead, the same for every model of a run (the evaluate
  task passes the classes the set shares with the union of the training sets: the RegMean paper's protocol). A
  head lacking one of them never predicts it, and its gold examples stay: that class's F1 is 0 in the macro mean.
  So a model that covers fewer of the set's classes is not scored on an easier task.
* NER: tags are matched by name; entity types the other side lacks become ``O`` in gold and are never predicted.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

import symfuse.evaluate.metrics as M
from symfuse.data.batches import IGNORE_INDEX
from symfuse.data.dataset import DatasetError, TaskDataset
from symfuse.data.labels import label_index, shared_label_names

log = logging.getLogger(__name__)


def _entity_type(tag: str) -> str | None:
    return None if tag == "O" else tag.split("-", 1)[-1]


def check_shared_classes(dataset: TaskDataset, head_labels: Sequence[str]) -> list[str]:
    """The dataset's classes the head has too (by name, any case), before anything is computed.

    Raises:
        DatasetError: if head and dataset share no class.
    """
    classes = shared_label_names(dataset.labels, head_labels, restrict=None)
    if not classes:
        raise DatasetError(
            f"{dataset.name}: the model's classes {list(head_labels)} share none with the dataset's "
            f"{dataset.labels}; pass --labels-from with the dataset the head was trained on"
        )
    return classes


def score_logits(
    dataset: TaskDataset,
    head_labels: Sequence[str],
    head_problem: str,
    logits: Sequence[torch.Tensor],
    labels: Sequence[torch.Tensor],
    in_domain: bool | None = None,
    scored: Sequence[str] | None = None,
) -> dict:
    """Metrics of a head's logits against a dataset's gold labels (see the module docstring for the label rule).

    Args:
        dataset: The evaluated dataset (gold label ids index ``dataset.labels``).
        head_labels: The head's class names in output order.
        head_problem: The head's problem type (see :func:`~symfuse.evaluate.predict.head_problem_type`).
        logits: Per-batch logits.
        labels: Per-batch gold labels (as collated).
        in_domain: Whether the head was trained on this dataset (every class of the dataset is scored); None: when
            head and dataset have the same class names.
        scored: Out of domain: the dataset's classes to score whatever the head has (a class the head lacks is
            never predicted); None: the classes the head shares with the dataset.

    Returns:
        Metrics (floats), ``n`` (scored examples), ``classes`` (the scored class names), ``primary`` (metric name).

    Raises:
        DatasetError: if head and dataset share no class.
    """
    problem = dataset.problem_type
    primary = M.primary_metric(dataset.name, problem)
    if problem == "regression":
        pred = torch.cat([x.reshape(-1) for x in logits]).numpy()
        gold = torch.cat([y.reshape(-1) for y in labels]).numpy()
        mse = float(np.mean((pred - gold) ** 2))
        return {**M.pearson_spearman(pred, gold), "mse": mse, "n": len(gold), "primary": primary}
    if problem == "token_classification":
        return _score_ner(dataset, list(head_labels), logits, labels, primary)
    if in_domain is None:
        in_domain = set(label_index(head_labels)) == set(label_index(dataset.labels))
    classes = list(dataset.labels) if in_domain else shared_label_names(dataset.labels, head_labels)
    if not classes:
        classes = check_shared_classes(dataset, head_labels)
    if scored and not in_domain:
        classes = shared_label_names(dataset.labels, scored, restrict=None)
    elif not in_domain and (
        left := [c for c in shared_label_names(dataset.labels, head_labels, None) if c not in classes]
    ):
        log.warning(
            "%s: its classes are not the head's, so it is scored out of domain on the Ekman emotions both name; "
            "left out though both name them: %s (their examples are not scored)", dataset.name, ", ".join(left)
        )  # fmt: skip
    head_index = label_index(head_labels)
    h_idx = [head_index.get(c.casefold(), -1) for c in classes]
    g_idx = [dataset.labels.index(c) for c in classes]
    z = torch.cat(logits)[:, [max(i, 0) for i in h_idx]]  # (n, scored)
    if min(h_idx) < 0:  # classes the head lacks: never predicted
        z = z.masked_fill(torch.tensor([i < 0 for i in h_idx]), float("-inf"))
    y = torch.cat(labels)
    # one class per example, except a multi-label head on its own multi-label data (sigmoid > 0.5 per class)
    one_class = not (dataset.multi_label and in_domain)
    if head_problem == "multi_label_classification" and not one_class:
        pred = (torch.sigmoid(z) > 0.5).numpy()
    else:
        pred = np.eye(len(classes), dtype=bool)[z.argmax(-1).numpy()]
        if max(h_idx) < 0:  # a head with none of the scored classes predicts none of them
            pred[:] = False
    if dataset.multi_label:
        gold = y[:, g_idx].numpy().astype(bool)
        keep = gold.any(1) if not in_domain else np.ones(len(gold), dtype=bool)
    else:
        lookup = {g: i for i, g in enumerate(g_idx)}
        ids = np.array([lookup.get(int(t), -1) for t in y])
        keep = ids >= 0
        gold = np.zeros((len(ids), len(classes)), dtype=bool)
        gold[np.flatnonzero(keep), ids[keep]] = True
    pred, gold = pred[keep], gold[keep]
    out = {
        "macro_f1": M.macro_f1(pred, gold),
        "micro_f1": M.micro_f1(pred, gold),
        "accuracy": M.accuracy(pred, gold),
        "per_class_f1": dict(zip(classes, map(float, M.per_class_f1(pred, gold)), strict=True)),
    }
    if not dataset.multi_label and (one_class or head_problem != "multi_label_classification"):
        out["matthews"] = M.matthews(pred.argmax(1), gold.argmax(1))
    out.update({"n": int(keep.sum()), "classes": classes, "in_domain": in_domain, "primary": primary})
    return out


def _score_ner(dataset: TaskDataset, head_tags: list[str], logits, labels, primary: str) -> dict:
    head_types = {_entity_type(t) for t in head_tags} - {None}
    data_types = {_entity_type(t) for t in dataset.labels} - {None}
    shared = head_types & data_types
    if not shared:
        raise DatasetError(f"{dataset.name}: the model's entity types {sorted(head_types)} share none with the data")
    allowed = [i for i, t in enumerate(head_tags) if t == "O" or _entity_type(t) in shared]
    pred_seqs, gold_seqs = [], []
    for z, y in zip(logits, labels, strict=True):
        masked = torch.full_like(z, float("-inf"))
        masked[..., allowed] = z[..., allowed]
        p = masked.argmax(-1)  # (batch, seq)
        for row_p, row_y in zip(p, y, strict=True):
            pos = row_y != IGNORE_INDEX
            gold = [dataset.labels[i] for i in row_y[pos].tolist()]
            gold_seqs.append([t if _entity_type(t) in shared else "O" for t in gold])
            pred_seqs.append([head_tags[i] for i in row_p[pos].tolist()])
    out = M.entity_f1(pred_seqs, gold_seqs)
    out.update({"n": len(gold_seqs), "entity_types": sorted(shared), "in_domain": head_types == data_types})
    out["primary"] = primary
    return out
