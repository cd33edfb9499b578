"""Tokenise a :class:`TaskDataset` split and collate it into padded model batches.

Batches are ``dict[str, Tensor]`` with ``input_ids`` / ``attention_mask`` (and ``token_type_ids`` when the
tokenizer makes them), all ``(batch, seq)`` padded to the longest sequence of the batch, plus ``labels``:

* single-label classification: ``(batch,)`` long class ids;
* multi-label classification: ``(batch, num_labels)`` float multi-hot;
* regression: ``(batch,)`` float;
* NER: ``(batch, seq)`` long tag ids on the FIRST sub-token of each word, ``-100`` on other sub-tokens, special
  tokens and padding (the value ``CrossEntropyLoss`` ignores).
"""

from __future__ import annotations

import functools
import logging
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from symfuse.data.dataset import TaskDataset, subsample_indices
from symfuse.data.labels import columns_of

log = logging.getLogger(__name__)

IGNORE_INDEX = -100
LOG_LINES = 10  # INFO lines per tracked pass


def load_tokenizer(tokenizer: Any, config: Any = None) -> Any:
    """A tokenizer object for a tokenizer, a checkpoint folder, ``"minilm"`` or a hub id.

    A folder whose model has one token type (``type_vocab_size: 1``) gets a tokenizer that writes no
    ``token_type_ids``.

    Args:
        tokenizer: A tokenizer (returned as it is), or where to load one from.
        config: The folder's model config (an object or ``config.json``'s dict) when the caller holds it; None:
            its ``config.json`` is read.

    Raises:
        TokenizerError: the folder has no tokenizer files, or they make a tokenizer of a few tokens only
            (transformers would otherwise build one that maps every word to ``[UNK]``).
    """
    if not isinstance(tokenizer, (str, Path)):
        return tokenizer
    from transformers import AutoTokenizer

    from symfuse.checkpoint import resolve_checkpoint
    from symfuse.io import check_tokenizer, check_vocab_size

    folder = resolve_checkpoint(tokenizer)
    check_tokenizer(folder)
    tok = check_vocab_size(AutoTokenizer.from_pretrained(str(folder)), folder)
    segments = _config_value(config if config is not None else _folder_config(folder) or {}, "type_vocab_size")
    if isinstance(segments, int) and segments < 2 and "token_type_ids" in tok.model_input_names:
        # one token type (a BERT-like model so configured): a text pair's second segment, type 1, indexed past its
        # token-type embedding (IndexError). Segments are left out, as RoBERTa's tokenizer does.
        tok.model_input_names = [n for n in tok.model_input_names if n != "token_type_ids"]
    return tok


def encode_split(
    dataset: TaskDataset,
    tokenizer: Any,
    split: str = "train",
    max_length: int = 128,
    max_examples: int | None = None,
    seed: int = 13,
    space: Sequence[str] | None = None,
) -> list[dict[str, Any]]:
    """Tokenise one split into per-example features (python lists, unpadded).

    Args:
        dataset: The loaded task.
        tokenizer: A (fast) tokenizer or a folder/name accepted by :func:`load_tokenizer`.
        split: Split name.
        max_length: Truncation length in tokens (special tokens included).
        max_examples: Seeded random subset of this many examples (source order kept).
        seed: Seed of that subset.
        space: The label space the targets index (a head's classes in output order, :func:`~symfuse.data.labels.
            target_space`), classes matched by name; None: the dataset's own order.

    Returns:
        One dict per example: ``input_ids``, ``attention_mask``, maybe ``token_type_ids``, and ``labels``.

    Raises:
        ValueError: a class of the dataset missing from ``space``.
    """
    tok = load_tokenizer(tokenizer)
    data = dataset.split(split)
    idx = subsample_indices(len(data), max_examples, seed)
    if len(idx) < len(data):
        data = data.select(idx)
    l2i, width = dataset.label2id, len(dataset.labels)
    if space is not None:
        l2i, width = dict(zip(dataset.labels, columns_of(dataset.labels, space), strict=True)), len(space)
    feats: list[dict[str, Any]] = []
    tagged = lost = 0  # NER: words with an entity tag, and those the truncation cut off
    chunk = 1024
    for start in range(0, len(data), chunk):
        rows = data[start : start + chunk]  # column dict
        if dataset.is_token_task:
            enc = tok(rows["tokens"], is_split_into_words=True, truncation=True, max_length=max_length)
        elif dataset.is_pair:
            enc = tok(rows["text"], rows["text_pair"], truncation=True, max_length=max_length)
        else:
            enc = tok(rows["text"], truncation=True, max_length=max_length)
        keys = [k for k in ("input_ids", "attention_mask", "token_type_ids") if k in enc]
        for j in range(len(enc["input_ids"])):
            f = {k: enc[k][j] for k in keys}
            if dataset.is_token_task:
                f["labels"], cut = _token_labels(enc.word_ids(j), rows["tags"][j], l2i)
                tagged, lost = tagged + sum(t != "O" for t in rows["tags"][j]), lost + cut
            elif dataset.task == "regression":
                f["labels"] = float(rows["label"][j])
            elif dataset.multi_label:
                hot = [0.0] * width
                for name in rows["label"][j]:
                    hot[l2i[name]] = 1.0
                f["labels"] = hot
            else:
                f["labels"] = l2i[str(rows["label"][j])]
            feats.append(f)
    if lost:  # neither scored nor trained on: recall and F1 are of the words kept
        log.warning("%s/%s: %d of %d entity-tagged words lie past max_length %d tokens and are left out — raise "
                    "--max-length to keep them", dataset.name, split, lost, tagged, max_length)  # fmt: skip
    return feats


def _token_labels(word_ids: Sequence[int | None], tags: Sequence[str], l2i: dict[str, int]) -> tuple[list[int], int]:
    """Each token's label (on a word's first token; the rest ignored) and the tagged words truncation cut off."""
    labels, prev, last = [], None, -1
    for w in word_ids:
        labels.append(IGNORE_INDEX if w is None or w == prev else l2i[tags[w]])
        prev = w
        last = last if w is None else max(last, w)
    return labels, sum(t != "O" for t in tags[last + 1 :])


def padding_id(tokenizer: Any, config: Any = None) -> int:
    """The id batches are padded with: the config's ``pad_token_id``, else the tokenizer's pad, else its eos, else 0.

    A decoder's sequence classifier (GPT-2, Llama, ...) reads each row at its last token that is not
    ``config.pad_token_id``: padded with another id, every shorter row of a batch was scored at a pad.

    Args:
        tokenizer: The model's tokenizer.
        config: The model's config (an object or ``config.json``'s mapping), or None.
    """
    pad = config.get("pad_token_id") if isinstance(config, dict) else getattr(config, "pad_token_id", None)
    for candidate in (pad, tokenizer.pad_token_id, getattr(tokenizer, "eos_token_id", None)):
        if isinstance(candidate, int) and not isinstance(candidate, bool):
            return candidate
    return 0


def name_padding(model: torch.nn.Module, tokenizer: Any) -> int:
    """Give ``model.config`` the pad id batches use (:func:`padding_id`) when it names none; return that id.

    A decoder's classifier without one cannot score a batch of more than one row.
    """
    pad = padding_id(tokenizer, model.config)
    if getattr(model.config, "pad_token_id", None) is None:
        model.config.pad_token_id = pad
    return pad


def collate(features: Sequence[dict[str, Any]], pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """Pad a list of features (from :func:`encode_split`) into one batch of tensors (right padding).

    Args:
        features: Per-example features.
        pad_token_id: Id used to pad ``input_ids``.

    Returns:
        ``input_ids`` / ``attention_mask`` / ``token_type_ids`` ``(batch, seq)``, and ``labels`` (see module doc).
    """
    seq = max(len(f["input_ids"]) for f in features)
    out: dict[str, torch.Tensor] = {}
    for key, pad in (("input_ids", pad_token_id), ("attention_mask", 0), ("token_type_ids", 0)):
        if key in features[0]:
            out[key] = torch.tensor([f[key] + [pad] * (seq - len(f[key])) for f in features], dtype=torch.long)
    if "labels" in features[0]:
        first = features[0]["labels"]
        if isinstance(first, list) and isinstance(first[0], float):  # multi-hot (batch, num_labels)
            out["labels"] = torch.tensor([f["labels"] for f in features], dtype=torch.float32)
        elif isinstance(first, list):  # token labels (batch, seq)
            rows = [f["labels"] + [IGNORE_INDEX] * (seq - len(f["labels"])) for f in features]
            out["labels"] = torch.tensor(rows, dtype=torch.long)
        elif isinstance(first, float):
            out["labels"] = torch.tensor([f["labels"] for f in features], dtype=torch.float32)
        else:
            out["labels"] = torch.tensor([f["labels"] for f in features], dtype=torch.long)
    return out


def iter_batches(
    features: Sequence[dict[str, Any]],
    batch_size: int,
    pad_token_id: int = 0,
    shuffle: bool = False,
    seed: int = 13,
    by_length: bool = False,
) -> Iterator[dict[str, torch.Tensor]]:
    """Collated batches of ``batch_size`` features (the last may be smaller); seeded order when ``shuffle``.

    ``by_length`` batches examples of similar length together (stable sort by token count), so little compute goes
    to padding: for order-free uses such as evaluation, where every batch's logits stay paired with its labels.
    """
    if shuffle and by_length:
        raise ValueError("iter_batches: choose shuffle or by_length, not both")
    order = list(range(len(features)))
    if shuffle:
        random.Random(seed).shuffle(order)
    if by_length:
        order.sort(key=lambda i: len(features[i]["input_ids"]))
    for start in range(0, len(order), batch_size):
        yield collate([features[i] for i in order[start : start + batch_size]], pad_token_id)


def make_batches(
    dataset: TaskDataset | str,
    tokenizer: Any,
    split: str = "train",
    batch_size: int = 16,
    max_length: int = 128,
    max_examples: int | None = None,
    seed: int = 13,
    shuffle: bool = False,
    space: Sequence[str] | None = None,
    config: Any = None,
) -> list[dict[str, torch.Tensor]]:
    """Tokenised, padded batches of one split — the input of statistics collection and evaluation.

    Args:
        dataset: A :class:`TaskDataset` or a source for :func:`~symfuse.data.load_task_dataset`.
        tokenizer: A tokenizer, or a checkpoint folder / ``"minilm"`` whose tokenizer to load.
        split: ``train`` | ``validation`` | ``test``.
        batch_size: Examples per batch.
        max_length: Truncation length in tokens; with a checkpoint folder, at most the positions its model reads.
        max_examples: Seeded random subset of this many examples.
        seed: Seed of the subset and of ``shuffle``.
        shuffle: Seeded shuffle of the example order.
        space: The label space the targets index (see :func:`encode_split`); None: the dataset's own order.
        config: The model's config: its positions cap the length, its pad id pads (:func:`padding_id`); None: the
            checkpoint folder's ``config.json`` when ``tokenizer`` is a folder.

    Returns:
        Batches ``{"input_ids", "attention_mask", ["token_type_ids"], "labels"}`` (see the module docstring); of a
        language-modelling source (:mod:`symfuse.data.text`), batches of its texts without ``labels``.

    Example:
        >>> ds = load_task_dataset("dair_emotion")                          # doctest: +SKIP
        >>> for batch in make_batches(ds, "minilm", "train", 16, 64, 256):  # doctest: +SKIP
        ...     model(**{k: v for k, v in batch.items() if k != "labels"})
    """
    texts = None
    if isinstance(dataset, str):
        from symfuse.data.dataset import load_task_dataset
        from symfuse.data.text import is_language_modeling, text_split

        if is_language_modeling(dataset):  # texts, no labels: the inputs of activation statistics
            texts = text_split(dataset, split, max_examples, seed)
        else:
            dataset = load_task_dataset(dataset)
    folder = isinstance(tokenizer, str | Path)
    if config is None and folder:  # a checkpoint folder: its model's config (None for "minilm", a hub id)
        config = _folder_config(tokenizer)
    tok = load_tokenizer(tokenizer, config)
    if config is not None:  # the model's positions cap the length
        where = tokenizer if folder else getattr(config, "_name_or_path", None) or "the model"
        max_length = readable_length(max_length, config, where)
    if texts is not None:
        feats = [dict(tok(t, truncation=True, max_length=max_length)) for t in texts]
    else:
        feats = encode_split(dataset, tok, split, max_length, max_examples, seed, space)
    return list(iter_batches(feats, batch_size, padding_id(tok, config), shuffle=shuffle, seed=seed))


# Families whose position ids start after the padding index (RoBERTa's embeddings): pad_token_id + 1 fewer positions.
_OFFSET_POSITIONS = frozenset(
    {"roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "data2vec-text", "roberta-prelayernorm", "mpnet"}
)


def _config_value(config: Any, key: str) -> Any:
    """``key`` of a model config: a ``PretrainedConfig`` or ``config.json``'s dict (None when absent)."""
    return config.get(key) if isinstance(config, dict) else getattr(config, key, None)


def config_positions(config: Any) -> int | None:
    """The token positions a model reads, from its config (an object or ``config.json``'s dict), or None if unknown.

    ``max_position_embeddings`` / ``n_positions``, less the offset of RoBERTa-style position ids.
    """
    get = functools.partial(_config_value, config)
    n = get("max_position_embeddings") or get("n_positions")
    if not isinstance(n, int) or n <= 0:
        return None
    if get("model_type") in _OFFSET_POSITIONS:
        n -= int(get("pad_token_id") or 0) + 1
    return n if n > 0 else None


def _folder_config(folder: str | Path) -> dict | None:
    """A checkpoint folder's ``config.json`` as a dict; None for a name without a folder (``minilm``, a hub id)."""
    import json

    file = Path(folder) / "config.json"
    return json.loads(file.read_text()) if file.is_file() else None


def model_positions(folder: str | Path) -> int | None:
    """The positions a checkpoint folder's model reads (see :func:`config_positions`), or None."""
    config = _folder_config(folder)  # None: "minilm", a hub id: their models read more than any default max_length
    return None if config is None else config_positions(config)


def readable_length(max_length: int, config: Any, what: object = "the model") -> int:
    """``max_length`` capped at the positions the model of ``config`` reads: longer texts are cut there.

    ``config``: the model's config, ``config.json``'s dict, or the checkpoint folder (a name without a folder, such
    as ``minilm``, caps nothing). A longer cap would hand the model position ids it has no embedding for (a size
    mismatch deep in its forward).
    """
    n = model_positions(config) if isinstance(config, str | Path) else config_positions(config)
    if n is None or max_length <= n:
        return max_length
    log.info("%s reads %d token positions: texts are cut at %d tokens (max_length %d)", what, n, n, max_length)
    return n


def batches_per_model(
    sources: Sequence[TaskDataset | str],
    tokenizers: Sequence[Any],
    split: str = "train",
    batch_size: int = 16,
    max_length: int = 128,
    max_examples: int | None = None,
    seed: int = 13,
) -> list[list[dict[str, torch.Tensor]]]:
    """Each model's own data as :func:`make_batches`, tokenised by that model's tokenizer (source i with tokenizer i).

    Every dataset is loaded before any is tokenised, so a bad source fails before the work on the others.

    Raises:
        DatasetError: a source cannot be loaded.
    """
    from symfuse.data.dataset import load_task_dataset

    datasets = [s if isinstance(s, TaskDataset) else load_task_dataset(s) for s in sources]
    return [
        make_batches(ds, tok, split, batch_size, max_length, max_examples, seed)
        for ds, tok in zip(datasets, tokenizers, strict=True)
    ]


def epoch_steps(
    features: list[dict[str, Any]], step_size: int, rng: random.Random, length_buckets: int | None
) -> list[list[int]]:
    """One epoch's optimizer steps as lists of example indices (see :mod:`symfuse.train.finetune`, batch order).

    Args:
        features: Encoded examples (``input_ids`` lengths are used).
        step_size: Examples per optimizer step (``batch_size * grad_accum``).
        rng: The epoch's seeded generator (consumed).
        length_buckets: Steps per length-sorted chunk; ``None`` for the plain shuffled order.

    Returns:
        ``ceil(len(features) / step_size)`` steps covering every example once.
    """
    order = list(range(len(features)))
    rng.shuffle(order)
    if length_buckets is None:
        return [order[i : i + step_size] for i in range(0, len(order), step_size)]
    width = step_size * length_buckets
    steps = []
    for start in range(0, len(order), width):
        chunk = sorted(order[start : start + width], key=lambda i: len(features[i]["input_ids"]))
        steps += [chunk[i : i + step_size] for i in range(0, len(chunk), step_size)]
    rng.shuffle(steps)
    return steps


def tracked_batches(
    batches: Iterable[Any], total: int, what: str, on_progress: Callable[[float], None] | None = None,
    start: float = 0.0, share: float = 1.0, logger: logging.Logger = log,
) -> Iterator[Any]:  # fmt: skip
    """Yield ``batches``; after each, call ``on_progress(start + share * done / total)`` and log ~10 INFO lines.

    Args:
        batches: The batches (any iterable; a generator is consumed lazily).
        total: How many batches there are.
        what: What the batches are for, in the log lines (e.g. ``"gram statistics"``).
        on_progress: Progress callback (fraction of the whole job, 0..1), or None.
        start: Fraction of the whole job done before these batches.
        share: Fraction of the whole job these batches are.
        logger: Where the lines go: the caller's logger, so that a run's log names the stage (``symfuse.stats.
            collect: gram statistics: batch 3/10``).
    """
    every = max(1, total // LOG_LINES)
    for i, batch in enumerate(batches, 1):
        yield batch
        if i % every == 0 or i == total:
            logger.info("%s: batch %d/%d", what, i, total)
        if on_progress is not None:
            on_progress(start + share * min(1.0, i / max(total, 1)))
