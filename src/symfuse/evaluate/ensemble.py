"""A merged model's per-dataset heads on a dataset none of them was trained on: the heads vote.

A merge of models with different label sets keeps ONE merged body and one head per dataset. Out of domain no head is
"the" head, and taking the one that shares the most class names lets one dataset's head decide alone (for emotion:
always meld's, the only set with every Ekman class). Here every head that shares a class with the dataset takes
part: a single-label head gives softmax probabilities over ITS OWN classes (so a head whose mass goes to classes the
dataset lacks says so), a multi-label head its sigmoid per class, and a class's score is the mean probability over
the heads that have that class (a head without the class abstains, it does not vote zero). The scores are then read
like one head over the shared classes (:func:`symfuse.evaluate.scoring.score_logits`, out of domain). With one
head this is that head's own prediction.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from symfuse.checkpoint import resolve_checkpoint
from symfuse.data import iter_batches, load_task_dataset
from symfuse.data.batches import encode_split
from symfuse.data.dataset import DatasetError, TaskDataset
from symfuse.data.labels import label_index, shared_label_names
from symfuse.evaluate.evaluate import write_json_atomic
from symfuse.evaluate.predict import head_label_names, head_problem_type, load_task_model, resolve_device, run_model
from symfuse.evaluate.scoring import score_logits

log = logging.getLogger(__name__)


def vote(
    heads: Sequence[tuple[Sequence[str], torch.Tensor]], classes: Sequence[str], multi: Sequence[bool] | None = None
) -> torch.Tensor:
    """Log of the mean probability of each of ``classes`` over the heads that have it.

    Args:
        heads: ``(head class names, logits (n, len(names)))`` per head.
        classes: The classes to score (each must be in at least one head, case-insensitively).
        multi: Per head, whether it is a multi-label head (a sigmoid per class; default: none is): its probability
            of a class is that sigmoid; a single-label head's is its softmax over its own classes.

    Returns:
        ``(n, len(classes))`` log-scores; argmax is the ensemble's prediction.
    """
    multi = list(multi) if multi is not None else [False] * len(heads)
    total = torch.zeros(heads[0][1].shape[0], len(classes), dtype=torch.float64)
    count = torch.zeros(len(classes), dtype=torch.float64)
    for (names, logits), sigmoid in zip(heads, multi, strict=True):
        index = label_index(names)
        probs = torch.sigmoid(logits.double()) if sigmoid else torch.softmax(logits.double(), dim=-1)
        for j, c in enumerate(classes):
            i = index.get(c.casefold())
            if i is not None:
                total[:, j] += probs[:, i]
                count[j] += 1
    if (count == 0).any():
        missing = [c for c, k in zip(classes, count.tolist(), strict=True) if k == 0]
        raise ValueError(f"no head has class(es) {missing}")
    return (total / count).log()


def _head_logits(
    model: str | Path, ds: TaskDataset, how: Mapping[str, Any]
) -> tuple[list[str] | None, torch.Tensor, torch.Tensor, bool]:
    """One head on ``ds``: ``(class names, logits (n, classes), gold labels, multi-label head)``.

    The names are None when the head shares no class with ``ds``.

    ``how``: :func:`evaluate_heads`' ``split``, ``max_examples``, ``device``, ``batch_size``, ``max_length``, ``seed``.
    """
    path = resolve_checkpoint(model)
    net, tok = load_task_model(path, how["device"])
    names = head_label_names(net.config)
    problem = head_problem_type(net.config)
    if problem not in ("single_label_classification", "multi_label_classification"):
        raise DatasetError(f"{path}: a {problem} head cannot vote on classes; evaluate it on its own")
    multi = problem == "multi_label_classification"
    if not shared_label_names(ds.labels, names):
        return None, torch.empty(0), torch.empty(0), multi
    feats = encode_split(ds, tok, how["split"], how["max_length"], how["max_examples"], how["seed"])
    batches = iter_batches(feats, how["batch_size"], tok.pad_token_id or 0, by_length=True)  # same order, every head
    dev = resolve_device(how["device"])
    logits, gold, _ = run_model(net, batches, None, dev, amp=dev.type == "cuda")
    return names, torch.cat(logits), torch.cat(gold), multi


def evaluate_heads(
    models: Sequence[str | Path],
    data: str,
    split: str = "test",
    max_examples: int | None = None,
    device: str = "cpu",
    batch_size: int = 64,
    max_length: int = 128,
    seed: int = 13,
    out_file: Path | None = None,
) -> dict:
    """Metrics of several classification heads (checkpoint folders sharing a body) voting on a dataset, as JSON.

    Args:
        models: Checkpoint folders, one per head; heads sharing no class with the dataset are left out.
        data: Dataset source (see :func:`symfuse.data.load_task_dataset`).
        split: ``test`` | ``validation`` | ``train``.
        max_examples: Seeded random subset of the split.
        device: ``cpu`` or ``cuda[:i]``.
        batch_size: Evaluation batch size.
        max_length: Truncation length in tokens.
        seed: Seed of the subset.
        out_file: Where to write the JSON (default ``<first model>/eval_<dataset>_<split>_heads.json``).

    Returns:
        The metrics of :func:`symfuse.evaluate.scoring.score_logits` plus ``heads`` (the folders that voted),
        ``head_labels`` (the classes scored), ``n``, ``seconds`` and the settings.

    Raises:
        DatasetError: if no head shares a class with the dataset, or a head is not a classifier.
    """
    t0 = time.perf_counter()
    ds = load_task_dataset(data)
    how = dict(split=split, max_examples=max_examples, device=device, batch_size=batch_size, max_length=max_length,
               seed=seed)  # fmt: skip
    voters: list[tuple[list[str], torch.Tensor]] = []
    sigmoid: list[bool] = []
    used: list[str] = []
    gold = None
    for model in models:
        names, logits, gold_here, multi = _head_logits(model, ds, how)
        if names is None:
            continue
        voters.append((names, logits))
        sigmoid.append(multi)
        used.append(str(model))
        gold = gold_here
    if not voters:
        raise DatasetError(f"{ds.name}: none of the {len(models)} heads shares a class with {ds.labels}")
    classes = list(dict.fromkeys(c for names, _ in voters for c in shared_label_names(ds.labels, names)))
    scores = vote(voters, classes, sigmoid)
    metrics = score_logits(ds, classes, "single_label_classification", [scores.float()], [gold], in_domain=False)
    metrics.update(
        {
            "heads": used,
            "head_labels": classes,
            "dataset": ds.name,
            "data": str(data),
            "split": split,
            "max_examples": max_examples,
            "max_length": max_length,
            "data_fingerprint": ds.fingerprint,
            "seconds": time.perf_counter() - t0,
        }
    )
    out_file = Path(out_file) if out_file else resolve_checkpoint(models[0]) / f"eval_{ds.name}_{split}_heads.json"
    write_json_atomic(metrics, out_file)
    log.info("%d heads voting on %s/%s: %s = %.4f (n=%d)", len(used), ds.name, split, metrics["primary"],
             metrics[metrics["primary"]], metrics["n"])  # fmt: skip
    return metrics
