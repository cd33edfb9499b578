"""Language-modelling datasets: a local folder whose ``meta.json`` says ``"task": "language_modeling"``.

Each record is ``{"text": str}`` (a speech of tinyshakespeare, a document). Such a dataset has no labels: the
causal LMs evaluated on it are scored by their next-token loss (:mod:`symfuse.evaluate.language`); fine-tuning,
statistics and merges read classification and NER datasets only.
"""

from __future__ import annotations

from pathlib import Path

from symfuse.data.dataset import _resolve_local, subsample_indices
from symfuse.data.files import DatasetError, read_records

LM_TASK = "language_modeling"


def is_language_modeling(source: str) -> bool:
    """Whether ``source`` is a local dataset whose ``meta.json`` declares the language-modelling task.

    Raises:
        DatasetError: a local source that cannot be read (see :func:`symfuse.data.load_task_dataset`).
    """
    if source.startswith("hf:"):
        return False
    local = _resolve_local(source)
    return local is not None and (local[2] or {}).get("task") == LM_TASK


def text_split(source: str, split: str, max_examples: int | None = None, seed: int = 13) -> list[str]:
    """The non-empty texts of ``split`` of a language-modelling dataset (a seeded subset, source order kept).

    Args:
        source: A local language-modelling dataset (:func:`is_language_modeling`).
        split: ``train`` | ``validation`` | ``test``.
        max_examples: Keep this many texts at most (None: all).
        seed: Seed of the subset.

    Raises:
        DatasetError: no such split, a record without a string ``text`` (file and line named), or no text at all.
    """
    local = _resolve_local(source)
    if local is None or (local[2] or {}).get("task") != LM_TASK:
        raise DatasetError(f"{source}: not a language-modelling dataset (its meta.json must say task {LM_TASK!r})")
    files = local[1]
    if split not in files:
        raise DatasetError(f"{source}: no {split} split — it has {', '.join(sorted(files))}; pass --split")
    texts = []
    for lineno, rec in read_records(files[split]):
        text = rec.get("text")
        if not isinstance(text, str):
            raise DatasetError(
                f"{files[split]}:{lineno}: no string field 'text' — a language-modelling record is {{\"text\": ...}}"
            )
        if text.strip():
            texts.append(text)
    if not texts:
        raise DatasetError(f"{files[split]}: no text in split {split}")
    return [texts[i] for i in subsample_indices(len(texts), max_examples, seed)]


def text_dataset_name(source: str) -> str:
    """The name a language-modelling dataset goes by in reports: its folder's name, or the bare name given."""
    path = Path(source)
    return path.name if path.is_dir() else source
