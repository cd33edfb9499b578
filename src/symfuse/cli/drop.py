"""``symfuse drop``: put a checkpoint where the watcher looks (``runs/<run>/incoming/<name>`` in the store)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from symfuse.cli import app
from symfuse.errors import OutputExistsError, UsageError

if TYPE_CHECKING:
    from symfuse.store import ArtifactStore

SHOWN_RUNS = 5


@app.command("drop")
def drop(
    checkpoint: Annotated[Path, typer.Argument(help="Checkpoint folder (save_pretrained output, safetensors).")],
    run: Annotated[
        str,
        typer.Option(
            "--run",
            help="Run id whose watcher (watch-checkpoints) picks it up: a run the store has (any run in a new store).",
        ),
    ],
    dataset: Annotated[
        str | None,
        typer.Option(
            "--dataset",
            help="Dataset it was fine-tuned on, which the re-merge evaluates it on: one of the run's datasets, or "
            "one found here. Default: --name.",
        ),
    ] = None,
    name: Annotated[
        str | None,
        typer.Option(
            "--name",
            help="Its model name in the run and in incoming/: the name of one of the run's models replaces that "
            "model, another adds a model (default: --dataset, else the folder's name).",
        ),
    ] = None,
    store_root: Annotated[
        str | None, typer.Option("--store", help="Store root (default $SYMFUSE_STORE, else ./symfuse-runs).")
    ] = None,
    replace: Annotated[
        bool, typer.Option("--replace", help="Publish over a checkpoint of the same name (a new version).")
    ] = False,
) -> None:
    """Validate CHECKPOINT, then store it as runs/RUN/incoming/NAME (the watcher ignores plain copies).

    Only the checkpoint's own files are stored: config.json, the weights (and shard index), tokenizer and
    generation files; a training folder's checkpoint-*/, optimizer states and logs stay behind.
    """
    if not checkpoint.is_dir():
        raise UsageError(f"CHECKPOINT {checkpoint}: not a folder — give the folder save_pretrained wrote")
    from symfuse.store import layout

    # how the dataset was given, for messages: the option, or the name it was taken from
    flag = "--dataset" if dataset else "--name" if name else "the folder's name"
    name = name or dataset or checkpoint.resolve().name
    try:
        key = layout.incoming_key(run, name)
        if dataset is not None:
            layout.check_segment(dataset, "--dataset")
    except ValueError as exc:
        raise UsageError(f"{exc}; pick another --run / --name / --dataset") from exc
    store = _store(store_root, run)
    _check_outside(store, checkpoint)
    from symfuse.checkpoint import validate_checkpoint

    validate_checkpoint(checkpoint, tokenizer=True)  # config, shapes, NaN / inf, tokenizer: before any upload
    models = store.folders(layout.models_prefix(run))  # the run's models (one listing: a store round trip)
    _check_fits_run(store, run, models, dataset, checkpoint)
    _check_dataset(run, models, dataset or name, name, flag)
    if store.exists(key) and not replace:
        raise OutputExistsError(
            f"{store.uri(key)} exists; pass --replace to publish a new version of it, or another --name"
        )
    from symfuse.io import checkpoint_files
    from symfuse.outputs import mark_published
    from symfuse.scratch import linked_dir

    with linked_dir(checkpoint, checkpoint_files(checkpoint), "drop") as files:  # not checkpoint-*/, optimizer, ...
        uri = store.put_dir(key, files, "symfuse drop", meta={"dataset": dataset or name})
    mark_published(uri)
    typer.echo(f"dropped {checkpoint} as {uri} (dataset {dataset or name}); the next watch-checkpoints tick of run "
               f"{run!r} emits it for a re-merge")  # fmt: skip


def _check_outside(store: ArtifactStore, checkpoint: Path) -> None:
    """Refuse a local store inside the checkpoint folder: each drop would copy the store into itself."""
    root = store.root.removeprefix("file://")
    if "://" in root:
        return
    real, folder = Path(root).resolve(), checkpoint.resolve()
    if real == folder or folder in real.parents:
        raise UsageError(f"--store {store.root}: inside CHECKPOINT {checkpoint}, so the drop would copy the store into "
                         "itself — keep the store outside the checkpoint folder")  # fmt: skip


def _check_fits_run(store: ArtifactStore, run: str, names: list[str], dataset: str | None, checkpoint: Path) -> None:
    """Refuse a checkpoint whose family or shapes differ from the run's model (of ``dataset``, else its first one).

    ``names``: the run's models (the folders under its ``models/``).

    The watcher's re-merge would fail on it, long after the drop said it was taken. A run with no model yet passes.
    """
    import json

    from symfuse.store import layout

    name = dataset if dataset in names else (names[0] if names else None)
    if name is None or not store.exists(key := layout.model_key(run, name)):
        return
    theirs, ours = _shape(json.loads(store.read_member(key, "config.json"))), _shape(checkpoint / "config.json")
    if theirs != ours:
        raise UsageError(
            f"CHECKPOINT {checkpoint}: {ours[1]} — run {run}'s model {name} is {theirs[1]}; the re-merge could not use "
            "it: drop a fine-tune of the run's base model"
        )


def _check_dataset(run: str, models: list[str], dataset: str, name: str, flag: str) -> None:
    """Refuse a dataset the re-merge could not evaluate on, or a run model's name for another dataset.

    A checkpoint named as one of the run's models replaces it, so it must be of that model's dataset. Any other
    name brings a new model, evaluated on its dataset: one the run has a model of, else one the re-merge (hub access
    off, as every flow runs) finds locally, or an explicit hub id (``owner/name``, ``hf:<id>``). A run with no model
    yet is not checked (its datasets are not known here).
    """
    if not models:
        return
    if name in models and dataset != name:
        raise UsageError(f"--name {name}: it replaces run {run}'s model of dataset {name}, but --dataset is "
                         f"{dataset} — give another --name for a model of {dataset}")  # fmt: skip
    if dataset in models or "/" in dataset or dataset.startswith("hf:"):
        return
    from symfuse.data.locate import find_named_dataset, not_found_message

    if find_named_dataset(dataset) is None:
        given = f"{flag} {dataset}" + ("" if flag == "--dataset" else " (the dataset, as no --dataset was given)")
        raise UsageError(
            f"{given}: run {run} has no model of that dataset (its datasets: {', '.join(models)}), and as a "
            f"new dataset for the re-merge to evaluate on: {not_found_message(dataset)}"
        )


def _shape(config: dict | Path) -> tuple[Any, str]:
    """``(family and geometry, "a <family> model (<shapes>)")`` of a config.json (a path or its parsed dict)."""
    from transformers import AutoConfig

    from symfuse.arch.registry import get_spec
    from symfuse.symmetry.widen import describe

    cfg = AutoConfig.from_pretrained(str(config.parent)) if isinstance(config, Path) else AutoConfig.for_model(**config)
    spec = get_spec(cfg)
    geometry, vocab = spec.geometry(cfg), getattr(cfg, "vocab_size", None)  # the embeddings are merged too
    return (spec.family, geometry, vocab), f"a {spec.family} model ({describe(geometry)}, vocabulary {vocab})"


def _store(store_root: str | None, run: str) -> ArtifactStore:
    """The store to drop into: a root that can be written, holding run ``run`` or no run yet.

    A store with no run takes a checkpoint for any run (a watcher may be set up before the run's first start); in a
    store that has runs, a run it has no folder for is a typo more often than a new run.

    Raises:
        UsageError: the root is a file (or under one) or not writable; the store has runs but not ``run``.
    """
    from symfuse.store import ArtifactStore, default_root, layout
    from symfuse.store.roots import store_root_problem
    from symfuse.store.urls import lasting_store_problem

    root = store_root or default_root()
    label = "--store" if store_root else "store root ($SYMFUSE_STORE, else ./symfuse-runs)"
    problem = lasting_store_problem(root, label) or store_root_problem(
        root, label, "give a folder (created if missing) or a URL such as s3://bucket/prefix"
    )
    if problem:
        raise UsageError(problem)
    store = ArtifactStore(root)
    runs = store.folders(layout.runs_prefix())
    if runs and run not in runs:
        more = f" and {len(runs) - SHOWN_RUNS} more" if len(runs) > SHOWN_RUNS else ""
        raise UsageError(
            f"--run {run}: the store {store.root} has no run {run} (its runs: {', '.join(runs[:SHOWN_RUNS])}{more}) "
            f"— check --run, or start the run first: python -m flows --config RUN.yaml --run-id {run}"
        )
    return store
