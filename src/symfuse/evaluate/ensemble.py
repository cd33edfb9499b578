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
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from symfuse.checkpoint import resolve_checkpoint
from symfuse.data import iter_batches, load_task_dataset, tracked_batches
from symfuse.data.batches import encode_split, padding_id, readable_length
from symfuse.data.dataset import DatasetError, TaskDataset
from symfuse.data.labels import label_index, shared_label_names
from symfuse.device import resolve_device
from symfuse.evaluate.evaluate import write_json_atomic
from symfuse.evaluate.predict import head_label_names, head_problem_type, load_task_model, run_model
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


@dataclass
class _Head:
    path: Path
    net: torch.nn.Module
    tok: Any
    names: list[str]
    multi: bool


def _load_head(model: str | Path, device: str) -> _Head:
    path = resolve_checkpoint(model)
    net, tok = load_task_model(path, device)
    problem = head_problem_type(net.config)
    if problem not in ("single_label_classification", "multi_label_classification"):
        raise DatasetError(f"{path}: a {problem} head cannot vote on classes; evaluate it on its own")
    return _Head(path, net, tok, head_label_names(net.config), problem == "multi_label_classification")


def head_module(a: torch.nn.Module, b: torch.nn.Module) -> str | None:
    """The one sub-module in which two models of the same body differ (their heads), or None.

    None when they are equal, or differ anywhere else (names, shapes or values of parameters and buffers outside
    that module), or only at their root: then each must run on its own.
    """
    sa, sb = a.state_dict(), b.state_dict()
    differ = set(sa) ^ set(sb)
    differ |= {k for k in sa.keys() & sb.keys() if sa[k].shape != sb[k].shape or not torch.equal(sa[k], sb[k])}
    if not differ:
        return None
    paths = [k.split(".")[:-1] for k in differ]  # module paths of the differing tensors
    common = paths[0]
    for path in paths[1:]:
        n = 0
        while n < min(len(common), len(path)) and common[n] == path[n]:
            n += 1
        common = common[:n]
    name = ".".join(common)
    has = {n for n, _ in a.named_modules()} & {n for n, _ in b.named_modules()}
    return name if common and name in has else None


class _Stacked(torch.nn.Module):
    """Several heads on one input: their outputs concatenated along the last (class) dimension."""

    def __init__(self, heads: Sequence[torch.nn.Module]) -> None:
        super().__init__()
        self.heads = torch.nn.ModuleList(heads)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.cat([h(*args, **kwargs) for h in self.heads], dim=-1)


def _heads_logits(
    models: Sequence[str | Path], ds: TaskDataset, how: Mapping[str, Any]
) -> tuple[list[_Head], list[torch.Tensor], torch.Tensor]:
    """The heads sharing a class with ``ds``, their logits ``(n, classes)`` on it, and the gold labels.

    ``how``: the settings of :func:`evaluate_heads`, and ``on_progress`` (None, or called with the fraction of the
    ``len(models)`` heads' passes done after every batch).

    Heads whose model equals the first voter's except in one sub-module (a merged model's per-dataset heads: one
    body) share ONE pass of that body: the sub-module is replaced, for the pass, by all of them side by side (only
    their sub-modules are kept). Any other head runs on its own. Models are loaded one at a time.
    """
    votes = _Votes(ds, how, len(models))
    for model in models:
        votes.add(_load_head(model, how["device"]))
    if votes.first is None:
        return [], [], votes.gold
    votes.run_shared()
    return votes.voters, [votes.out[i] for i in range(len(votes.voters))], votes.gold


class _Votes:
    """The voters' logits on one dataset, gathered head by head (see :func:`_heads_logits`)."""

    def __init__(self, ds: TaskDataset, how: Mapping[str, Any], heads: int = 1):
        self.ds, self.how = ds, how
        self.heads, self.done = max(1, heads), 0  # voters to run, and how many have had their pass
        self.dev = resolve_device(how["device"])
        self.order: list[int] = []  # every head sees the examples in ONE order: the first voter's, shortest first
        self.first: _Head | None = None
        self.feats: list = []  # the first voter's encoded split
        self.shared: list[tuple[int, torch.nn.Module]] = []  # (voter index, head sub-module) on the first one's body
        self.name: str | None = None  # the sub-module the shared heads replace
        self.voters: list[_Head] = []
        self.out: dict[int, torch.Tensor] = {}
        self.gold = torch.empty(0)

    def _run(self, net: torch.nn.Module, feats: list, pad: int, heads: int = 1) -> torch.Tensor:
        """Logits of ``net`` on ``feats`` (in :attr:`order`): one pass for ``heads`` voters.

        Its batches are logged and reported as the share of every voter's pass done (``how["on_progress"]``).
        """
        report: Callable[[float], None] | None = self.how.get("on_progress")
        done, share = self.done / self.heads, heads / self.heads
        batches = tracked_batches(iter_batches([feats[j] for j in self.order], self.how["batch_size"], pad),
                                  math.ceil(len(feats) / self.how["batch_size"]), f"{self.ds.name} votes",
                                  report, done, share, log)  # fmt: skip
        logits, gold, _ = run_model(net, batches, None, self.dev, amp=self.dev.type == "cuda")
        self.done += heads
        self.gold = torch.cat(gold)
        return torch.cat(logits)

    def add(self, head: _Head) -> None:
        """Take ``head`` as a voter if it shares a class with the dataset: its logits now, or its sub-module kept."""
        if not shared_label_names(self.ds.labels, head.names):
            return
        how = self.how
        i = len(self.voters)
        self.voters.append(head)
        length = readable_length(how["max_length"], head.net.config, "a voter")
        mine = encode_split(self.ds, head.tok, how["split"], length, how["max_examples"], how["seed"])
        if self.first is None:
            self.first, self.feats = head, mine
            self.order = sorted(range(len(mine)), key=lambda j: len(mine[j]["input_ids"]))  # little padding
            return
        here = head_module(self.first.net, head.net) if mine == self.feats else None
        if here is not None and (self.name is None or here == self.name):
            self.name = here
            self.shared.append((i, head.net.get_submodule(here)))
        else:
            self.out[i] = self._run(head.net, mine, padding_id(head.tok, head.net.config))
        head.net = None  # only the head sub-module (or the logits) is kept

    def _run_with(self, module: torch.nn.Module | None, heads: int) -> torch.Tensor:
        """The first voter's body on its data with ``module`` in place of sub-module ``name`` for the pass."""
        first = self.first
        assert first is not None
        pad = padding_id(first.tok, first.net.config)
        if module is None:
            return self._run(first.net, self.feats, pad, heads)
        own = first.net.get_submodule(self.name)
        first.net.set_submodule(self.name, module)
        try:
            return self._run(first.net, self.feats, pad, heads)
        finally:
            first.net.set_submodule(self.name, own)

    def run_shared(self) -> None:
        """The first voter and the heads sharing its body: one stacked pass, or each on its own when it must."""
        ids = [0, *(i for i, _ in self.shared)]  # the voters run on the first one's body, in stacking order
        widths = [len(self.voters[i].names) for i in ids]
        stacked = None
        if self.shared:
            modules = [self.first.net.get_submodule(self.name), *(m for _, m in self.shared)]
            stacked = self._run_with(_Stacked(modules), len(ids))
        if stacked is not None and stacked.shape[-1] == sum(widths):
            self.out |= dict(zip(ids, stacked.split(widths, dim=-1), strict=True))
        else:  # no shared heads, or a model that reshapes its head's output: each head on its own
            for i, module in [(0, None), *self.shared]:
                self.out[i] = self._run_with(module, 1)


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
    scored: list[str] | None = None,
    on_progress: Callable[[float], None] | None = None,
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
        scored: The classes to score, whatever the heads have (see :func:`symfuse.evaluate.scoring.score_logits`);
            None: those the heads share with the dataset.
        on_progress: Called with the fraction of the heads' passes done (0..1] after every batch (it may raise to
            stop the evaluation).

    Returns:
        The metrics of :func:`symfuse.evaluate.scoring.score_logits` plus ``heads`` (the folders that voted),
        ``head_labels`` (the classes scored), ``n``, ``seconds`` and the settings.

    Raises:
        DatasetError: if no head shares a class with the dataset, or a head is not a classifier.
    """
    t0 = time.perf_counter()
    ds = load_task_dataset(data)
    how = dict(split=split, max_examples=max_examples, device=device, batch_size=batch_size, max_length=max_length,
               seed=seed, on_progress=on_progress)  # fmt: skip
    heads, logits, gold = _heads_logits(models, ds, how)
    if not heads:
        raise DatasetError(f"{ds.name}: none of the {len(models)} heads shares a class with {ds.labels}")
    voters = [(h.names, z) for h, z in zip(heads, logits, strict=True)]
    sigmoid = [h.multi for h in heads]
    used = [str(h.path) for h in heads]
    classes = list(dict.fromkeys(c for names, _ in voters for c in shared_label_names(ds.labels, names)))
    scores = vote(voters, classes, sigmoid)
    metrics = score_logits(ds, classes, "single_label_classification", [scores.float()], [gold], in_domain=False,
                           scored=scored)  # fmt: skip
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
