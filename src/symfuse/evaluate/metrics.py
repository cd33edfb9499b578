"""Task metrics: macro-F1 (emotion), entity-level micro-F1 (NER, seqeval), accuracy / Matthews / Pearson-Spearman.

All functions take plain arrays / lists and return python floats, so they can be checked against hand-computed
values. :func:`primary_metric` names the metric that selects the best epoch and that reports lead with.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# GLUE tasks scored by accuracy / Matthews (the others: macro-F1 for classification, Pearson for regression).
_ACCURACY_TASKS = ("sst2", "mrpc", "rte")
_MATTHEWS_TASKS = ("cola",)


def primary_metric(name: str, problem_type: str) -> str:
    """The metric that ranks models for a dataset.

    ``f1`` (NER), ``pearson`` (regression), ``matthews`` (CoLA), ``accuracy`` (SST-2, MRPC, RTE), else ``macro_f1``.
    """
    if problem_type == "token_classification":
        return "f1"
    if problem_type == "regression":
        return "pearson"
    if name in _MATTHEWS_TASKS:
        return "matthews"
    if name in _ACCURACY_TASKS:
        return "accuracy"
    return "macro_f1"


def per_class_f1(pred: np.ndarray, gold: np.ndarray) -> np.ndarray:
    """F1 of each column of two multi-hot ``(n, classes)`` 0/1 matrices (0 where a class is neither predicted nor gold).

    For single-label data pass one-hot rows: the columns' F1 are then the usual per-class F1.
    """
    pred, gold = np.asarray(pred).astype(bool), np.asarray(gold).astype(bool)
    tp = (pred & gold).sum(0).astype(float)
    denom = pred.sum(0) + gold.sum(0)  # 2tp + fp + fn
    return np.divide(2 * tp, denom, out=np.zeros_like(tp), where=denom > 0)


def macro_f1(
    pred: Sequence[int] | np.ndarray, gold: Sequence[int] | np.ndarray, num_classes: int | None = None
) -> float:
    """Unweighted mean of per-class F1 over classes present in gold or predictions (sklearn's ``average="macro"``).

    Args:
        pred: Class ids ``(n,)`` or a multi-hot matrix ``(n, classes)``.
        gold: Same layout as ``pred``.
        num_classes: Number of classes for id inputs (default: the largest id + 1).
    """
    pred, gold = np.asarray(pred), np.asarray(gold)
    if pred.ndim == 1:
        k = num_classes or int(max(pred.max(initial=0), gold.max(initial=0))) + 1
        pred, gold = np.eye(k, dtype=bool)[pred], np.eye(k, dtype=bool)[gold]
    present = pred.astype(bool).any(0) | gold.astype(bool).any(0)
    if not present.any():
        return 0.0
    return float(per_class_f1(pred, gold)[present].mean())


def micro_f1(pred: np.ndarray, gold: np.ndarray) -> float:
    """Micro-averaged F1 of two multi-hot matrices."""
    pred, gold = np.asarray(pred).astype(bool), np.asarray(gold).astype(bool)
    tp = (pred & gold).sum()
    denom = pred.sum() + gold.sum()
    return float(2 * tp / denom) if denom else 0.0


def accuracy(pred: Sequence[int] | np.ndarray, gold: Sequence[int] | np.ndarray) -> float:
    """Share of exactly right predictions (rows must match entirely for 2-D inputs)."""
    pred, gold = np.asarray(pred), np.asarray(gold)
    same = pred == gold
    return float(same.all(-1).mean() if same.ndim > 1 else same.mean())


def matthews(pred: Sequence[int] | np.ndarray, gold: Sequence[int] | np.ndarray) -> float:
    """Matthews correlation coefficient (multi-class R_K form; equals the binary MCC for two classes)."""
    pred, gold = np.asarray(pred), np.asarray(gold)
    k = int(max(pred.max(initial=0), gold.max(initial=0))) + 1
    c = np.zeros((k, k), dtype=float)
    np.add.at(c, (gold, pred), 1)
    t, p, n, correct = c.sum(1), c.sum(0), c.sum(), np.trace(c)
    cov = correct * n - t @ p
    denom = np.sqrt((n**2 - p @ p) * (n**2 - t @ t))
    return float(cov / denom) if denom else 0.0


def pearson_spearman(pred: Sequence[float], gold: Sequence[float]) -> dict[str, float]:
    """Pearson and Spearman correlation of scores (0 for constant inputs)."""
    from scipy.stats import pearsonr, spearmanr

    pred, gold = np.asarray(pred, dtype=float), np.asarray(gold, dtype=float)
    if pred.std() == 0 or gold.std() == 0:
        return {"pearson": 0.0, "spearman": 0.0}
    return {"pearson": float(pearsonr(pred, gold)[0]), "spearman": float(spearmanr(pred, gold)[0])}


def entity_f1(pred_tags: Sequence[Sequence[str]], gold_tags: Sequence[Sequence[str]]) -> dict[str, float]:
    """Entity-level micro precision / recall / F1 (seqeval, BIO, default non-strict mode) and token accuracy.

    An entity counts only if its type and its exact span match.
    """
    from seqeval.metrics import f1_score, precision_score, recall_score

    pred_l, gold_l = [list(p) for p in pred_tags], [list(g) for g in gold_tags]
    tokens = sum(len(g) for g in gold_l)
    right = sum(a == b for p, g in zip(pred_l, gold_l, strict=True) for a, b in zip(p, g, strict=True))
    return {
        "precision": float(precision_score(gold_l, pred_l, zero_division=0)),
        "recall": float(recall_score(gold_l, pred_l, zero_division=0)),
        "f1": float(f1_score(gold_l, pred_l, zero_division=0)),
        "token_accuracy": right / tokens if tokens else 0.0,
    }
