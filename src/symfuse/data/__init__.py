"""Datasets: local JSON Lines folders, files and hub ids through the datasets library.

Public API: :func:`load_task_dataset` -> :class:`TaskDataset`; :func:`make_batches` (tokenised, padded batches with
``labels``: class ids, float multi-hot, float scores, or NER tag ids on first sub-tokens and -100 elsewhere);
the lower-level :func:`encode_split` / :func:`collate` / :func:`iter_batches` (and :func:`tracked_batches`, which
logs and reports a pass over them); :func:`shared_label_names` for
out-of-domain evaluation; :func:`dataset_search_path` / :func:`bundled_datasets` (where a bare name is found: see
:mod:`symfuse.data.locate`).
"""

from symfuse.data.batches import (
    IGNORE_INDEX,
    batches_per_model,
    collate,
    encode_split,
    iter_batches,
    load_tokenizer,
    make_batches,
    tracked_batches,
)
from symfuse.data.dataset import (
    SPLITS,
    DatasetError,
    TaskDataset,
    load_task_dataset,
    subsample_indices,
)
from symfuse.data.labels import EMOTION_SHARED, shared_label_names
from symfuse.data.locate import bundled_datasets, dataset_search_path, shared_datasets_dir

__all__ = [
    "EMOTION_SHARED",
    "IGNORE_INDEX",
    "SPLITS",
    "DatasetError",
    "TaskDataset",
    "batches_per_model",
    "bundled_datasets",
    "collate",
    "dataset_search_path",
    "encode_split",
    "iter_batches",
    "load_task_dataset",
    "load_tokenizer",
    "make_batches",
    "shared_datasets_dir",
    "shared_label_names",
    "subsample_indices",
    "tracked_batches",
]
