"""A run's inputs checked before any task starts: every problem as one line naming the artifact and the fix.

:func:`check_run` looks at everything a :class:`~symfuse.config.RunConfig` names, cheaply: the base model and each
brought checkpoint (resolved, ``config.json`` read, a known family, the tokenizer files a fine-tune needs) and every
training, out-of-domain and selection dataset (resolved by the project's dataset lookup, ``meta.json`` and the first
records of each split read by :func:`symfuse.data.probe.probe_dataset`: no tensor is loaded and no dataset read
whole). It returns ALL the problems it finds, one line each:

* a model or dataset that is not there, unreadable, or malformed (the file and line named), or trained on twice;
* a split the run reads that the dataset lacks (the fine-tune's train split, the statistics' train split, the
  evaluation split, greedy selection's and ``ood_heads: reliable``'s validation; a fine-tune without a validation
  split scores its epochs on a slice held out of train, never on test: :mod:`symfuse.data.holdout`);
* a device this machine does not have (``device: cuda`` on a machine without a GPU);
* a local store root that is a file (or under one), or not writable;
* a strategy that cannot merge the run's number of models (one per dataset: slerp two, any merge two or more);
* label sets the run cannot use: ``labels: union`` over datasets that are not classification, a model scored on an
  evaluation set with which its head shares no class (every model is scored on every evaluation set; a head without
  class names on none), a brought checkpoint whose head lacks classes of its dataset that its Fisher statistics take
  as targets, or whose head cannot be that dataset's (see :func:`symfuse.data.labels.data_mismatch`) while its head
  refit / RegMean++ statistics read it (unless ``allow_label_mismatch``).

``fusion_pipeline`` raises :class:`RunInputError` (:func:`require_runnable`) before it submits any task, and
``python -m flows`` prints the lines before it starts Prefect.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from symfuse.config import RunConfig
from symfuse.data.labels import (
    data_mismatch,
    foreign_classes,
    head_labels,
    shared_label_names,
    short_names,
    too_few_classes,
    union_label_names,
    unnamed,
)
from symfuse.data.probe import DatasetProbe, offline_hub_problem, probe_dataset, twin_datasets
from symfuse.errors import DataError, SymfuseError
from symfuse.preflight_strategies import strategy_problems, weights_problems
from symfuse.store.roots import brought_uri_problem, store_root_problem


class RunInputError(DataError):
    """A run's inputs have problems; ``problems`` holds one line each (the message: all of them, one per line)."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


def require_runnable(config: RunConfig) -> None:
    """Raise if :func:`check_run` finds any problem.

    Raises:
        RunInputError: every problem, one line each.
    """
    if problems := check_run(config):
        raise RunInputError(problems)


@dataclass(frozen=True)
class _Head:
    """The classes a model of the run predicts, and whether they are known (None: they could not be read)."""

    kind: str  # "token", "sequence" or "regression"
    labels: tuple[str, ...] | None


def _kind(task: str) -> str:  # a task's head kind
    return {"ner": "token", "regression": "regression"}.get(task, "sequence")


def check_run(config: RunConfig) -> list[str]:
    """Every problem with the inputs of ``config``, one line each (``<artifact>: <what is wrong> — <fix>``).

    Args:
        config: The run.

    Returns:
        The problems, in the order: base model, training datasets, brought checkpoints, evaluation and selection
        sets, label compatibility; empty when the run may start.
    """
    problems: list[str] = []
    trained = [d.name for d in config.datasets if d.checkpoint is None]
    base_problems, base_config = _check_base(config.base_model, tokenizer=bool(trained))
    problems += base_problems
    problems += _device_problems(config)
    problems += _store_problems(config)
    problems += strategy_problems(config) + weights_problems(config)
    if not config.evaluation.in_domain and not config.evaluation.out_of_domain:  # the report would find no metric
        problems.append("evaluation: in_domain is false and out_of_domain is empty — nothing would be evaluated; set "
                        "in_domain: true or name a set under out_of_domain")  # fmt: skip
    problems += _symmetry_problems(config, base_config)
    probes: dict[str, DatasetProbe] = {}
    for d in config.datasets:
        probe = _probe(f"training dataset {d.name}", d.data, _training_splits(config, d.name), problems)
        if probe is not None:
            probes[d.name] = probe
            if d.task and probe.task and d.task != probe.task:  # task: is a claim about the data, checked here
                problems.append(f"training dataset {d.name}: task: {d.task}, but {probe.where} holds {probe.task} "
                                "data — fix task:, or drop it (meta.json says the task)")  # fmt: skip
    heads = _heads(config, probes, problems, _resolved(config.base_model) if trained else None)
    others = _evaluation_sets(config)
    sets: dict[str, DatasetProbe] = {n: p for n, p in probes.items() if n in others}
    for name, (splits, role) in others.items():
        if name in config.dataset_names:
            continue
        probe = _probe(f"{role} {name}", name, splits, problems)
        if probe is not None:
            sets[name] = probe
    problems += twin_datasets(config.datasets, probes, sets, config.evaluation.out_of_domain)
    problems += _label_problems(config, probes, heads, sets)
    return problems


# ------------------------------------------------------------------------------------------------- models


def _device_problems(config: RunConfig) -> list[str]:
    """The run's device on this machine, which runs the flow and its in-process tasks (match, merge, evaluate).

    ``auto`` and ``cpu`` are always there (torch is not imported for them); a CUDA device this machine lacks is one
    line, before the fine-tunes start rather than when the first task asks for it.
    """
    if config.device in ("auto", "cpu"):
        return []
    try:
        config.resolved_device()
    except SymfuseError as exc:
        return [_one_line(exc)]
    return []


def _store_problems(config: RunConfig) -> list[str]:
    """A local store root must be a folder, or a path whose nearest existing parent is a writable folder.

    A URL (``s3://...``) is reached when the run first writes; a file there would fail each task's upload after
    its work (a fine-tune retried three times), so it is one line now.
    """
    fix = "give a folder (created if missing) or a URL such as s3://bucket/prefix in store_root or $SYMFUSE_STORE"
    return [p] if (p := store_root_problem(config.resolved_store_root(), "store_root", fix)) else []


def _check_base(base: str, tokenizer: bool) -> tuple[list[str], dict | None]:
    """The base model's problems and its ``config.json`` (None when unreadable).

    The checks: resolvable, config.json readable with a known model_type, tokenizer files.
    """
    from symfuse.checkpoint import resolve_checkpoint
    from symfuse.io import check_tokenizer

    raw = None
    try:
        folder = resolve_checkpoint(base)
        raw = _family(folder)
        if tokenizer:
            check_tokenizer(folder)
    except SymfuseError as exc:
        return [f"base model {base}: {_one_line(exc, base)}"], raw
    return [], raw


def _symmetry_problems(config: RunConfig, base_config: dict | None) -> list[str]:
    """``residual-orthogonal`` needs one anchor model and a family where a map of the whole stream is exact.

    ``base_config``: the base's ``config.json`` (None: unreadable, already reported as the base's problem).
    """
    from symfuse.arch import get_spec
    from symfuse.symmetry.residual_orthogonal import check_supported

    if "residual-orthogonal" not in config.symmetries:
        return []
    if config.anchor == "barycenter":
        return ["symmetries: residual-orthogonal maps each model onto one anchor model, not onto a barycenter — set "
                "anchor to 'closest' or a dataset name"]  # fmt: skip
    if base_config is None:
        return []
    try:
        check_supported(get_spec(base_config))
    except SymfuseError as exc:
        return [f"symmetries: residual-orthogonal on base model {config.base_model}: {_one_line(exc)} (in a run "
                "config: drop residual-orthogonal)"]  # fmt: skip
    return []


def _family(folder: Path) -> dict:
    """``config.json`` of a checkpoint folder, whose model_type a family covers (else the error naming the file)."""
    from symfuse.arch import get_spec
    from symfuse.config_json import read_config_json, unknown_model_type
    from symfuse.errors import UnsupportedArchitecture

    raw = read_config_json(folder)
    try:
        get_spec(raw)
    except UnsupportedArchitecture as exc:
        raise unknown_model_type(folder, raw.get("model_type")) from exc
    return raw


def _heads(
    config: RunConfig, probes: dict[str, DatasetProbe], problems: list[str], reference: Path | None
) -> dict[str, _Head]:
    """The head of each model of the run: a fine-tune's follows its dataset (or the union), a brought one's config.

    A brought checkpoint must be mergeable with ``reference`` (the base; None: the first brought one).
    """
    from symfuse.checkpoint import resolve_checkpoint

    union = None
    if config.labels == "union" and all(p.complete for p in probes.values()):
        union = tuple(union_label_names(p.labels for p in probes.values()))
    heads: dict[str, _Head] = {}
    role = "the base"
    for d in config.datasets:
        probe = probes.get(d.name)
        if d.checkpoint is None:
            if probe is not None and probe.read:
                labels = union if config.labels == "union" else probe.labels if probe.complete else None
                heads[d.name] = _Head(_kind(probe.task or ""), labels)
            continue
        if "://" in d.checkpoint:  # a store URI: read when the run brings it; it must be there to be brought
            if problem := brought_uri_problem(config.resolved_store_root(), d.checkpoint):
                problems.append(f"checkpoint of {d.name} {problem}")
            continue
        try:
            folder = resolve_checkpoint(d.checkpoint)
            heads[d.name] = _head_of(_family(folder), folder)
            if reference is None:
                reference, role = folder, f"the checkpoint of {d.name}"
            elif problem := _not_mergeable(folder, reference, role):
                problems.append(f"checkpoint of {d.name} {d.checkpoint}: {problem}")
        except SymfuseError as exc:
            problems.append(f"checkpoint of {d.name} {d.checkpoint}: {_one_line(exc, d.checkpoint)}")
    return heads


def _resolved(base: str) -> Path | None:
    from symfuse.checkpoint import resolve_checkpoint

    with contextlib.suppress(SymfuseError):  # reported as the base's problem
        return resolve_checkpoint(base)
    return None


def _not_mergeable(folder: Path, reference: Path, role: str) -> str | None:
    """Why ``folder``'s model cannot be merged with ``reference``'s (family, shapes, file headers), else None."""
    from symfuse.checkpoint import CheckpointReader
    from symfuse.pairing import shape_problems

    with CheckpointReader(folder) as src, CheckpointReader(reference) as ref:
        problem, _ = shape_problems(src, ref, role)
    return None if problem is None else f"{problem} — the run merges models of one architecture and size"


def _head_of(raw: dict, folder: Path) -> _Head:
    """A checkpoint's head from its ``config.json``: class names (``id2label``), token or sequence, or regression.

    Raises:
        CheckpointError: no classification head (a bare body or a language model), or an ``id2label`` that
            misnumbers or renames its outputs.
    """
    from symfuse.config_json import check_head_labels
    from symfuse.errors import CheckpointError

    check_head_labels(folder, raw)
    names = head_labels(raw)
    if names is None:
        archs = ", ".join(raw.get("architectures") or []) or "none"
        raise CheckpointError(
            f"{folder}/config.json: no classification head (architectures: {archs}) — bring a fine-tuned task model"
        )
    if raw.get("problem_type") == "regression" or len(names) == 1:
        return _Head("regression", ())
    token = any("TokenClassification" in a for a in raw.get("architectures") or [])
    return _Head("token" if token else "sequence", tuple(names))


# ------------------------------------------------------------------------------------------------- datasets


def _training_splits(config: RunConfig, name: str) -> dict[str, str]:
    """Split -> why the run reads it, for the training dataset ``name``."""
    d = config.dataset(name)
    need: dict[str, str] = {}
    if d.checkpoint is None:
        need["train"] = "the fine-tune trains on it"  # and, without validation, scores epochs on a slice of it
    if config.stats_kinds() or config.head_refit.enabled or _reads_data(config.strategies):
        need.setdefault("train", "statistics (and head refit) are collected on it")
    if config.evaluation.in_domain:
        need[config.evaluation.split] = f"in-domain evaluation reads it (evaluation.split: {config.evaluation.split})"
    if config.select == "greedy" and config.select_on is None:
        need["validation"] = "greedy selection scores the models on it (select: greedy)"
    if config.evaluation.ood_heads == "reliable" and config.evaluation.out_of_domain and len(config.datasets) > 1:
        need["validation"] = "evaluation.ood_heads: reliable rates each head on it"
    return need


def _evaluation_sets(config: RunConfig) -> dict[str, tuple[dict[str, str], str]]:
    """Every set models are scored on besides their training sets' test splits: name -> (splits needed, role)."""
    split = config.evaluation.split
    sets: dict[str, tuple[dict[str, str], str]] = {}
    for name in config.evaluation.out_of_domain:
        sets[name] = ({split: f"out-of-domain evaluation reads it (evaluation.split: {split})"}, "out-of-domain set")
    if config.select == "greedy":
        for name in [config.select_on] if config.select_on else config.dataset_names:
            why = {"validation": "greedy selection scores the models on it (select_on)"}
            splits, role = sets.get(name, ({}, "selection set (select_on)"))
            sets[name] = (splits | why, role)
    return sets


def _probe(what: str, source: str, splits: dict[str, str], problems: list[str]) -> DatasetProbe | None:
    """Probe one dataset; append its problems (unreadable, or a split missing) and return it (None: unreadable)."""
    try:
        probe = probe_dataset(source)
    except SymfuseError as exc:
        text = _one_line(exc, source)  # the source's name taken off the front; a file in it stays named
        label = what if source == what.rsplit(" ", 1)[-1] or source in text else f"{what} ({source})"
        problems.append(f"{label}: {text}")
        return None
    if not probe.read:  # a hub dataset: not read here, but it must be reachable
        if why := offline_hub_problem(source):
            problems.append(f"{what}: {why}")
        return probe
    for split, why in splits.items():
        if not any(s in probe.splits for s in split.split("|")):
            first = split.split("|")[0]
            problems.append(
                f"{what}: no {split.replace('|', ' or ')} split in {probe.where} (it has {', '.join(probe.splits)}); "
                f"{why} — add {first}.jsonl there, or change the run config"
            )
    return probe


# ------------------------------------------------------------------------------------------------- labels


def _label_problems(
    config: RunConfig, probes: dict[str, DatasetProbe], heads: dict[str, _Head], sets: dict[str, DatasetProbe]
) -> list[str]:
    """Label policy and evaluation compatibility (checked where the label sets are known in full)."""
    out: list[str] = []
    if config.labels == "per-dataset":
        for d in config.datasets:
            p = probes.get(d.name)
            if d.checkpoint is None and p is not None and p.complete:
                few = too_few_classes(p.task, p.multi_label, p.labels)
                out += [f"training dataset {d.name} ({p.where}): {few}"] if few else []
    if config.labels == "union":
        for name, p in probes.items():
            if p.read and p.task not in ("classification", "pair_classification"):
                out.append(
                    f"training dataset {name}: labels: union needs classification datasets, {name} is {p.task} — "
                    "use labels: per-dataset, or drop the dataset"
                )
    scored = dict(sets) | (dict(probes) if config.evaluation.in_domain else {})
    fine_tuned = {d.name for d in config.datasets if d.checkpoint is None and config.labels == "per-dataset"}
    reported: set[frozenset[str]] = set()
    for model, head in heads.items():
        brought = config.dataset(model).checkpoint is not None
        if head.labels and unnamed(head.labels):  # once for the model, not once per set
            sets_ = [n for n, p in scored.items() if p.read and p.complete and _kind(p.task or "") == head.kind]
            if sets_:
                out.append(
                    f"checkpoint of {model} {config.dataset(model).checkpoint}: its head has no class names "
                    f"({short_names(head.labels)}), and every evaluation set ({', '.join(sets_)}) scores it by class "
                    f"name — bring a checkpoint of {model} whose config.json id2label names {model}'s classes"
                )
            continue
        for name, p in scored.items():
            pair = frozenset((model, name))
            if (name == model and not brought) or (pair <= fine_tuned and pair in reported):  # a pair of sets: once
                continue
            problem = _scoring_problem(model, head, name, p)
            if problem:
                reported.add(pair)
                out.append(f"evaluation set {name}: {problem} — {_scoring_fix(config, model, name, brought)}")
    if _fisher(config):  # the empirical Fisher reads a brought model's own data's classes as its head's targets
        for model, head in heads.items():
            p, checkpoint = probes.get(model), config.dataset(model).checkpoint
            problem = foreign_classes(head.labels or (), p.labels) if checkpoint and p and p.complete else None
            if problem:
                out.append(
                    f"checkpoint of {model} {checkpoint}: its Fisher statistics take {model}'s classes as targets: "
                    f"{problem} — bring the checkpoint fine-tuned on {model}, or drop the fisher strategy"
                )
    if config.allow_label_mismatch or not (config.head_refit.enabled or _reads_data(config.strategies)):
        return out
    for model, head in heads.items():  # a brought model's head refit / RegMean++ read its dataset's texts
        p, checkpoint = probes.get(model), config.dataset(model).checkpoint
        if checkpoint is None or p is None or not p.complete or model in scored:  # scored there: reported above
            continue
        problem = data_mismatch(head.labels or (), p.labels, p.task == "regression")
        if problem:
            out.append(
                f"checkpoint of {model} {checkpoint}: its head refit / RegMean++ statistics read {model}, which "
                f"{problem} — bring the checkpoint fine-tuned on {model}, or set allow_label_mismatch: true"
            )
    return out


_HEAD_KINDS = {"token": "token-classification (NER)", "sequence": "sequence-classification", "regression": "regression"}


def head_task_problem(folder: str | Path, source: str) -> str | None:
    """Why the head of the checkpoint in ``folder`` cannot read dataset ``source``'s targets, or None.

    A regression set on a classifier, a classification set on a regression head, NER on a sequence head (and back)
    failed deep inside the forward pass with a shape or dtype error. Only the kinds are compared: class names are
    mapped by the commands themselves. A model without a classification head, or a hub dataset, passes.
    """
    from symfuse.config_json import head_labels_problem, read_config_json
    from symfuse.errors import CheckpointError

    try:
        raw = read_config_json(Path(folder))
    except CheckpointError:  # the checkpoint checks name it
        return None
    data = probe_dataset(source)
    # a malformed id2label is named by the checkpoint checks, with the file
    if head_labels_problem(raw) or head_labels(raw) is None or not data.read or not data.task:
        return None
    head = _head_of(raw, Path(folder))
    if head.kind == _kind(data.task):
        return None
    kind, fix = _HEAD_KINDS[head.kind], "give a dataset of its task, or a model fine-tuned on it"
    return f"a {data.task} dataset, and {folder} has a {kind} head — {fix}"


def _scoring_problem(model: str, head: _Head, name: str, data: DatasetProbe) -> str | None:
    """Why the model of ``model`` (its ``head``) cannot be scored on the set ``name`` (``data``), else None.

    None too where the labels are not known in full (a hub set, labels not declared in meta.json).
    """
    if not data.read:
        return None
    kind = _kind(data.task or "")
    if head.kind != kind:
        return f"the model of {model} has a {head.kind} head, {name} is a {data.task} task"
    if kind == "regression" or head.labels is None or not data.complete:
        return None
    if shared_label_names(data.labels, head.labels, restrict=None):
        return None
    return f"the head of {model} ({short_names(head.labels)}) shares no class with {name} ({short_names(data.labels)})"


def _scoring_fix(config: RunConfig, model: str, name: str, brought: bool) -> str:
    if brought:
        return f"bring a checkpoint of {model} whose config.json id2label names {model}'s classes"
    if name in config.dataset_names:
        return (
            "every model is scored on every training set: set evaluation.in_domain: false, or use sets sharing classes"
        )
    return f"every model is scored on it: drop {name} from evaluation.out_of_domain (or select_on)"


def _fisher(config: RunConfig) -> bool:
    return "fisher" in config.stats_kinds()


def _reads_data(strategies: Iterable[str]) -> bool:
    from symfuse.merge.registry import MERGERS

    return any(getattr(MERGERS[s], "needs_data", False) for s in strategies)


def _one_line(exc: BaseException, named: str | None = None) -> str:
    """The error's first line; without the leading ``"<named>: "`` when the caller names that artifact itself."""
    line = " ".join(str(exc).split("\n", 1)[0].split()) or type(exc).__name__
    return line.removeprefix(f"{named}: ") if named else line
