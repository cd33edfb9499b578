"""Label spaces shared between datasets (out-of-domain emotion evaluation, the union label space).

Class names are matched case-insensitively everywhere here (``Joy`` and ``joy`` are one class); results keep the
spelling of the side they are taken from.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from symfuse.data.files import DatasetError

# Ekman's basic emotions that the emotion datasets have in common (each dataset has some of them).
EMOTION_SHARED = ("anger", "disgust", "fear", "joy", "sadness", "surprise")


def _key(name: str) -> str:
    return str(name).casefold()


def shared_label_names(
    a: Iterable[str], b: Iterable[str], restrict: Iterable[str] | None = EMOTION_SHARED
) -> list[str]:
    """Class names two label spaces share (case-insensitively), in ``a``'s order and spelling.

    Args:
        a: First label space (e.g. the evaluated dataset's classes).
        b: Second label space (e.g. the model head's classes).
        restrict: Keep only these names (default: the six Ekman emotions); None keeps every common name.

    Returns:
        The shared names (may be empty).
    """
    names_b = {_key(n) for n in b}
    keep = {_key(n) for n in restrict} if restrict is not None else None
    return [n for n in a if _key(n) in names_b and (keep is None or _key(n) in keep)]


def label_index(names: Sequence[str]) -> dict[str, int]:
    """Case-insensitive class name -> position in ``names`` (the first spelling wins)."""
    out: dict[str, int] = {}
    for i, n in enumerate(names):
        out.setdefault(_key(n), i)
    return out


def union_label_names(spaces: Iterable[Sequence[str]]) -> list[str]:
    """The union of label spaces: every class once (case-insensitively), in order of first appearance.

    Args:
        spaces: Each training dataset's class names, in dataset order.

    Returns:
        The union's class names (the first spelling met is kept).
    """
    seen: dict[str, str] = {}
    for names in spaces:
        for n in names:
            seen.setdefault(_key(n), str(n))
    return list(seen.values())


UNNAMED = re.compile(r"LABEL_\d+")  # transformers' names for the classes of a head saved without names


LM_HEADS = ("ForCausalLM", "LMHeadModel")  # how a causal LM's class name ends: LlamaForCausalLM, GPT2LMHeadModel


def is_causal_lm(config: Any) -> bool:
    """Whether a checkpoint's class is a causal language model (``GPT2LMHeadModel``, ``LlamaForCausalLM`` ...).

    By how the class name ends: ``XLMRobertaForSequenceClassification`` holds "LM" and is a classifier.
    """
    return any(a.endswith(LM_HEADS) for a in getattr(config, "architectures", None) or ())


def head_labels(config: Any) -> list[str] | None:
    """A checkpoint's classification head's class names, in output order (``id2label``); None: no such head.

    Args:
        config: The checkpoint's config (``PretrainedConfig``) or its ``config.json`` dict (which omits the
            default two unnamed classes).
    """
    get = config.get if isinstance(config, Mapping) else lambda k, d=None: getattr(config, k, d)
    if not any("Classification" in a for a in get("architectures") or []):
        return None
    id2label = get("id2label") or {}
    if not id2label:
        return [f"LABEL_{i}" for i in range(int(get("num_labels") or 2))]
    return [str(id2label[k]) for k in sorted(id2label, key=int)]


def unnamed(names: Iterable[str]) -> bool:
    """Whether every class name is transformers' placeholder ``LABEL_<i>`` (a head saved without names)."""
    return all(UNNAMED.fullmatch(str(n)) for n in names)


def data_mismatch(head: Sequence[str], data: Sequence[str], regression: bool = False) -> str | None:
    """Why data with classes ``data`` is not a head's own data, or None (it may be).

    A named head shares at least one class with its data (case-insensitively); a head without names (``LABEL_i``)
    has as many outputs as its data has classes. Regression data (``regression``: a score per record, no class)
    is no head of two or more classes' data (a head refit on STS-B scores changed a classifier, exit 0).
    """
    if regression and len(head) > 1:
        return f"holds regression scores, no classes, for a head of {len(head)} classes ({short_names(head)})"
    if not head or not data:
        return None
    if unnamed(head):
        if len(head) == len(data):
            return None
        return f"has {len(data)} classes for a head of {len(head)} unnamed outputs"
    if shared_label_names(data, head, restrict=None):
        return None
    return f"shares no class with the head ({short_names(head)}); its classes: {short_names(data)}"


def foreign_classes(head: Sequence[str], data: Sequence[str]) -> str | None:
    """Why a head cannot take data's classes as its targets, else None: :func:`target_space`'s refusal, as text."""
    try:
        target_space(head, data)
    except ValueError as exc:
        return str(exc)
    return None


def same_names(a: Sequence[str], b: Sequence[str]) -> bool:
    """Whether two class lists name the same classes in the same order (case-insensitively)."""
    return [_key(n) for n in a] == [_key(n) for n in b]


def differ_in_classes(config_a: Any, config_b: Any) -> str | None:
    """How two checkpoints' classification heads name their classes differently (set or order), or None."""
    a, b = head_labels(config_a) or [], head_labels(config_b) or []
    if same_names(a, b):
        return None
    return f"their heads name their classes differently ({short_names(a)} / {short_names(b)})"


def target_space(head: Sequence[str] | None, data: Sequence[str]) -> list[str] | None:
    """The label space a head's targets index, for data with classes ``data`` (see :func:`encode_split`'s ``space``).

    A named head: its classes in output order (the data's classes matched by name, case-insensitively). None: the
    data's own order, for no head, no classes (regression) or a head without names (``LABEL_i``: class i is output i).

    Raises:
        ValueError: a class of the data that a named head lacks, or more classes than an unnamed head has outputs.
    """
    if not head or not data:
        return None
    if unnamed(head):
        if len(data) > len(head):
            raise ValueError(f"{len(data)} classes for the {len(head)} unnamed outputs of the head")
        return None
    index = label_index(head)
    missing = [str(c) for c in data if _key(c) not in index]
    if missing:
        raise ValueError(f"classes the head lacks: {short_names(missing)} (its classes: {short_names(list(head))})")
    return [str(n) for n in head]


def head_targets(config: Any, ds: Any, where: object, fix: str) -> list[str] | None:
    """:func:`target_space` of a checkpoint's head (``config``) for a dataset ``ds``, or one line naming both.

    Raises:
        DatasetError: ``"<data> on <where>: <why> — <fix>"`` (a class the head lacks, too many classes).
    """
    try:
        return target_space(head_labels(config), ds.labels)
    except ValueError as exc:
        raise DatasetError(f"{ds.source} on {where}: {exc} — {fix}") from None


def too_few_classes(task: str | None, multi_label: bool, labels: Sequence[str]) -> str | None:
    """Why a dataset cannot train a per-dataset classification head (one class or none), else None.

    A single-label head over one class has nothing to tell apart (and ``transformers`` refuses to load a
    ``single_label_classification`` head of one output). A union head (``labels: union``) may learn one class from a
    dataset: the union holds the others.
    """
    if task not in ("classification", "pair_classification") or multi_label or len(labels) >= 2:
        return None
    which = f"only one class ({labels[0]})" if labels else "no class"
    return (
        f"{which} — a classification head needs two or more to tell apart: add records of another class "
        "(and list it in meta.json's labels), or train with labels: union (--labels union)"
    )


def short_names(names: Sequence[str], n: int = 6) -> str:
    """The first ``n`` names, comma-separated, and how many there are in all (for messages)."""
    return ", ".join(names[:n]) + (f", ... {len(names)} in all" if len(names) > n else "")


def columns_of(labels: Sequence[str], space: Sequence[str]) -> list[int]:
    """Positions in ``space`` of each of ``labels`` (case-insensitive).

    Raises:
        ValueError: a label missing from ``space`` (the message names it).
    """
    index = label_index(space)
    missing = [n for n in labels if _key(n) not in index]
    if missing:
        raise ValueError(f"classes {missing} are not in the label space {list(space)}")
    return [index[_key(n)] for n in labels]


# ----------------------------------------------------------------------------------------------- union metadata

LABEL_SPACE_KEY = "symfuse_label_space"  # config.json entry of a union-head checkpoint (see :class:`LabelSpace`)


@dataclass(frozen=True)
class LabelSpace:
    """A union head's label metadata, stored in the checkpoint's ``config.json`` under :data:`LABEL_SPACE_KEY`.

    Attributes:
        labels: The head's classes, in output order (equal to ``config.id2label``).
        learned: Per class, whether the model was trained on it (loss was computed on that output).
        datasets: Dataset name -> the classes it has (the datasets the model, or the merged models, learned from).
    """

    labels: tuple[str, ...]
    learned: tuple[bool, ...]
    datasets: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The ``config.json`` entry."""
        return {
            "space": "union",
            "labels": list(self.labels),
            "learned": list(self.learned),
            "datasets": {k: list(v) for k, v in self.datasets.items()},
        }

    @property
    def learned_names(self) -> list[str]:
        """The classes some training data had."""
        return [n for n, ok in zip(self.labels, self.learned, strict=True) if ok]

    def covers(self, dataset: str, labels: Sequence[str]) -> bool:
        """Whether ``dataset`` (by name, with these classes) is one the head learned from (in-domain)."""
        mine = self.datasets.get(dataset)
        return mine is not None and {_key(n) for n in labels} == {_key(n) for n in mine}


def learned_space(labels: Sequence[str], dataset: str, dataset_labels: Sequence[str]) -> LabelSpace:
    """The :class:`LabelSpace` of a model fine-tuned on ``dataset`` with the union head ``labels``.

    Raises:
        ValueError: a class of the dataset missing from ``labels``.
    """
    cols = set(columns_of(dataset_labels, labels))
    return LabelSpace(tuple(labels), tuple(i in cols for i in range(len(labels))), {dataset: tuple(dataset_labels)})


def read_label_space(config: Any, where: object) -> LabelSpace | None:
    """The union label metadata of a checkpoint config (object or ``config.json`` dict); None for other heads.

    Raises:
        CheckpointError: the entry is malformed or disagrees with ``id2label`` (names ``where`` and the fix).
    """
    from symfuse.errors import CheckpointError

    get = config.get if isinstance(config, Mapping) else lambda k, d=None: getattr(config, k, d)
    raw = get(LABEL_SPACE_KEY)
    if raw is None:
        return None
    fix = "fine-tune it again with union labels (symfuse finetune --labels union)"
    if not isinstance(raw, Mapping) or raw.get("space") != "union":
        raise CheckpointError(f"{where}: config.json {LABEL_SPACE_KEY} is not a union label space; {fix}")
    labels, learned, datasets = raw.get("labels"), raw.get("learned"), raw.get("datasets") or {}
    if not isinstance(labels, list) or not all(isinstance(n, str) for n in labels):
        raise CheckpointError(f"{where}: config.json {LABEL_SPACE_KEY}.labels must be a list of names; {fix}")
    if not isinstance(learned, list) or len(learned) != len(labels) or not all(isinstance(b, bool) for b in learned):
        raise CheckpointError(
            f"{where}: config.json {LABEL_SPACE_KEY}.learned must hold one true/false per class ({len(labels)}); {fix}"
        )
    id2label = get("id2label") or {}
    head = [str(id2label[k]) for k in sorted(id2label, key=int)]
    if head != labels:
        raise CheckpointError(
            f"{where}: config.json id2label {head[:5]}... differs from {LABEL_SPACE_KEY}.labels {labels[:5]}...; {fix}"
        )
    if not isinstance(datasets, Mapping) or not all(isinstance(v, list) for v in datasets.values()):
        raise CheckpointError(f"{where}: config.json {LABEL_SPACE_KEY}.datasets must map names to class lists; {fix}")
    return LabelSpace(tuple(labels), tuple(learned), {str(k): tuple(map(str, v)) for k, v in datasets.items()})


def union_columns(config: Any, data: Any, where: object) -> list[int] | None:
    """The head outputs of ``data``'s classes when the head is a union head (see :class:`LabelSpace`), else None.

    ``data`` is a :class:`symfuse.data.dataset.TaskDataset` (its ``name``, ``task`` and ``labels`` are read).

    Raises:
        CheckpointError: malformed union metadata.
        ValueError: a class of ``data`` missing from the union, or a task that is not classification.
    """
    space = read_label_space(config, where)
    if space is None:
        return None
    if data.task not in ("classification", "pair_classification"):
        raise ValueError(f"{data.name}: union labels need a classification dataset, not {data.task}")
    try:
        return columns_of(data.labels, space.labels)
    except ValueError as exc:
        raise ValueError(f"{data.name}: {exc}; include this dataset in the union") from None
