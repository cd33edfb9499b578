"""Union heads: merge a classification head's class rows only over the models that learned each class.

With the union label space (:class:`symfuse.data.labels.LabelSpace`) every model has one head over the union of the
training datasets' classes, one binary classifier per class, trained only on the classes its dataset has. When
merging (RegMean paper, Appendix B), class ``c``'s head row (and its bias) is merged only from the models whose
``learned`` mask has ``c``, with the strategy's model weights renormalised over those models; a class learned by one
model keeps that model's row exactly, and a model never trained on a class contributes nothing to it. A class no
model learned keeps the first model's (untrained) row. Head tensors that are not per class (RoBERTa's
``classifier.dense``) are merged over every model like the body.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from symfuse.checkpoint import CheckpointReader
from symfuse.config_json import update_config_json
from symfuse.data.labels import LABEL_SPACE_KEY, LabelSpace, read_label_space
from symfuse.errors import CheckpointError
from symfuse.merge.base import TensorInputs

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class UnionHeads:
    """The K models' union label metadata, checked to agree.

    Attributes:
        spaces: Each model's :class:`LabelSpace`, in model order.
    """

    spaces: tuple[LabelSpace, ...]

    @property
    def labels(self) -> tuple[str, ...]:
        """The union's classes (head output order)."""
        return self.spaces[0].labels

    @property
    def learned(self) -> torch.Tensor:
        """``(K, classes)`` bool: which model learned which class."""
        return torch.tensor([list(s.learned) for s in self.spaces], dtype=torch.bool)

    def per_class(self, name: str, shape: Sequence[int], heads: set[str]) -> bool:
        """Whether tensor ``name`` is a head tensor with one row per class (the output layer's weight / bias)."""
        return name in heads and len(shape) >= 1 and shape[0] == len(self.labels)

    def merged(self) -> LabelSpace:
        """The merged model's metadata: a class is learned when some model learned it; every model's datasets."""
        learned = tuple(bool(x) for x in self.learned.any(0))
        datasets: dict[str, tuple[str, ...]] = {}
        for s in self.spaces:
            datasets.update(s.datasets)
        return LabelSpace(self.labels, learned, datasets)

    def learners(self) -> dict[str, list[int]]:
        """Class name -> the models (indices) that learned it."""
        m = self.learned
        return {c: [i for i in range(m.shape[0]) if m[i, j]] for j, c in enumerate(self.labels)}


def union_heads(configs: Sequence[object], where: Sequence[object]) -> UnionHeads | None:
    """The models' union label metadata when every one has a union head; None when none has.

    Args:
        configs: Each model's config (object or ``config.json`` dict).
        where: Each model's folder, for messages.

    Raises:
        CheckpointError: some models have union heads and others not, or their label lists differ.
    """
    spaces = [read_label_space(c, w) for c, w in zip(configs, where, strict=True)]
    if all(s is None for s in spaces):
        return None
    if any(s is None for s in spaces):
        plain = [str(w) for s, w in zip(spaces, where, strict=True) if s is None]
        raise CheckpointError(
            f"{plain[0]}: has a per-dataset head while other models have union heads; fine-tune every model with "
            "the same label space (--labels union with one --union-of list)"
        )
    first = spaces[0]
    for s, w in zip(spaces[1:], where[1:], strict=True):
        if s.labels != first.labels:  # type: ignore[union-attr]
            raise CheckpointError(
                f"{w}: its union labels {list(s.labels)[:6]}... differ from {where[0]}'s {list(first.labels)[:6]}... "  # type: ignore[union-attr]
                "(another union or order); fine-tune every model with the same --union-of list"
            )
    return UnionHeads(tuple(spaces))  # type: ignore[arg-type]


def head_names(reader: CheckpointReader) -> set[str]:
    """Tensors outside the base model (task heads); empty for a bare base model."""
    if not reader.prefix:
        return set()
    return {n for n in reader.names() if not n.startswith(reader.prefix)}


def merge_class_rows(
    merge: Callable[[TensorInputs], torch.Tensor], t: TensorInputs, learned: torch.Tensor
) -> torch.Tensor:
    """Merge a per-class head tensor row by row over the models that learned each class.

    Classes with the same set of learners are merged together by ONE call of ``merge`` on those models' rows
    (their Fishers' rows, their full Grams), with ``t.weights`` renormalised over them.

    Args:
        merge: The strategy's tensor merge (e.g. ``merger.merge_tensor``).
        t: The K models' tensor ``(classes, ...)`` and statistics.
        learned: ``(K, classes)`` bool mask of the classes each model learned.

    Returns:
        A new tensor: row ``c`` merged from the learners of ``c``; the learner's row exactly when one model learned
        ``c``; model 0's row when none did.
    """
    tensors = [x.clone() for x in _all(t.tensors)]  # a head is small: K copies, valid at once
    fisher = [x.clone() for x in _all(t.fisher)] if t.fisher is not None else None
    gram = [x.clone() for x in _all(t.gram)] if t.gram is not None else None
    out = tensors[0].clone()
    groups: dict[tuple[int, ...], list[int]] = {}
    for c in range(out.shape[0]):
        groups.setdefault(tuple(int(i) for i in torch.nonzero(learned[:, c]).flatten().tolist()), []).append(c)
    for who, rows in groups.items():
        idx = torch.tensor(rows, dtype=torch.long, device=out.device)
        if len(who) <= 1:  # one learner keeps its row exactly; no learner keeps model 0's initial row
            out[idx] = tensors[who[0] if who else 0][idx]
            continue
        w = [float(t.weights[i]) for i in who]
        total = sum(w)
        w = [x / total for x in w] if total > 0 else [1.0 / len(who)] * len(who)
        sub = replace(
            t,
            tensors=[tensors[i][idx] for i in who],
            weights=w,
            base=t.base[idx] if t.base is not None else None,
            fisher=[fisher[i][idx] for i in who] if fisher is not None else None,
            gram=[gram[i] for i in who] if gram is not None else None,
            gram_key=None,  # another subset of models: never reuse a factor computed for the full set
            part=True,
        )
        out[idx] = merge(sub).to(out.dtype)
    return out


def _all(xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Every element in memory of its own (a :class:`LazyTensors` slice reads each into new memory)."""
    return list(xs[:]) if hasattr(xs, "load") else list(xs)


def write_label_space(folder: Path, space: LabelSpace) -> None:
    """Set the union label metadata in ``folder/config.json`` (a folder being written, not yet published)."""
    update_config_json(Path(folder), {LABEL_SPACE_KEY: space.to_json()})
