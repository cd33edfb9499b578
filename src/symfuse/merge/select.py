"""Greedy subset selection: which models to merge (RegMean paper, section 5.2 / Figure 6; Wortsman et al. 2022).

The models are ordered by their own score on a validation set (best first). The best model starts the subset;
every next model is added when the merge of the subset with it scores higher on the validation set than the
subset so far, else it is left out. The result holds the chosen subset and the whole path (every subset tried,
its score, whether it was kept). Pure: merging and scoring are the caller's function.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Step:
    """One try of the greedy path.

    Attributes:
        added: The model tried.
        subset: The models merged in this try (the kept subset plus ``added``).
        score: The validation score of that merge (of ``added`` alone for the first step).
        kept: Whether ``added`` stayed in the subset.
    """

    added: str
    subset: tuple[str, ...]
    score: float
    kept: bool


@dataclass(frozen=True)
class Selection:
    """The chosen subset, its validation score and the path that led to it."""

    chosen: tuple[str, ...]
    score: float
    path: tuple[Step, ...]

    def to_json(self) -> dict:
        """A JSON-ready record (for reports)."""
        return {
            "chosen": list(self.chosen),
            "score": self.score,
            "path": [{"added": s.added, "subset": list(s.subset), "score": s.score, "kept": s.kept} for s in self.path],
        }


def greedy_order(order_scores: Mapping[str, float]) -> list[str]:
    """Model names by score, best first (ties keep the mapping's order).

    Raises:
        ValueError: no model, or a score that is not a finite number.
    """
    if not order_scores:
        raise ValueError("greedy selection needs at least one model")
    bad = {n: s for n, s in order_scores.items() if not isinstance(s, (int, float)) or not math.isfinite(s)}
    if bad:
        raise ValueError(f"greedy selection: validation scores {bad} are not finite numbers")
    position = {n: i for i, n in enumerate(order_scores)}
    return sorted(order_scores, key=lambda n: (-float(order_scores[n]), position[n]))


def select_greedy(order_scores: Mapping[str, float], merge_and_score: Callable[[Sequence[str]], float]) -> Selection:
    """Greedily pick the models to merge.

    Args:
        order_scores: Each model's own validation score (higher is better); fixes the order models are tried in.
        merge_and_score: Merges the given models (in the given order) and returns the merge's validation score on
            the same set and metric as ``order_scores``; called once per model after the first.

    Returns:
        The :class:`Selection`: the kept models (in the order they were added), the best validation score and the
        path of every try.

    Raises:
        ValueError: no model, or a score that is not a finite number.
    """
    order = greedy_order(order_scores)
    chosen = [order[0]]
    best = float(order_scores[order[0]])
    path = [Step(order[0], (order[0],), best, True)]
    for name in order[1:]:
        trial = (*chosen, name)
        score = float(merge_and_score(trial))
        if not math.isfinite(score):
            raise ValueError(f"greedy selection: the merge of {list(trial)} scored {score}, not a finite number")
        kept = score > best
        if kept:
            chosen, best = list(trial), score
        path.append(Step(name, trial, score, kept))
        log.info("greedy selection: %s -> %.4f (%s)", "+".join(trial), score, "kept" if kept else "left out")
    return Selection(tuple(chosen), best, tuple(path))


def validation_score(records: Sequence[Mapping]) -> float:
    """Greedy selection's score of one model: the mean primary metric of its evaluation records.

    Args:
        records: Evaluation records ``{"dataset", "metrics": {"primary": name, name: value, ...}}``, one per
            validation set.

    Raises:
        ValueError: no record, or one without a finite primary metric (the message names its dataset).
    """
    if not records:
        raise ValueError("greedy selection: no validation evaluation to score the model with")
    values = []
    for r in records:
        m = r.get("metrics") or {}
        v = m.get(m.get("primary", ""))
        if not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"greedy selection: the evaluation on {r.get('dataset')} has no finite primary metric")
        values.append(float(v))
    return sum(values) / len(values)
