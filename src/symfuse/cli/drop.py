"""``symfuse drop``: put a checkpoint where the watcher looks (``runs/<run>/incoming/<name>`` in the store)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from symfuse.cli import app
from symfuse.errors import OutputExistsError, UsageError


@app.command("drop")
def drop(
    checkpoint: Annotated[Path, typer.Argument(help="Checkpoint folder (save_pretrained output, safetensors).")],
    run: Annotated[str, typer.Option("--run", help="Run id whose watcher (watch-checkpoints) picks it up.")],
    dataset: Annotated[
        str | None,
        typer.Option(
            "--dataset",
            help="Dataset it was fine-tuned on (a configured dataset of that name: this checkpoint replaces its "
            "model in the re-merge; another name: a new model evaluated on that dataset). Default: --name.",
        ),
    ] = None,
    name: Annotated[
        str | None, typer.Option("--name", help="Its name in incoming/ (default: --dataset, else the folder's name).")
    ] = None,
    store_root: Annotated[
        str | None, typer.Option("--store", help="Store root (default $SYMFUSE_STORE, else ./symfuse-runs).")
    ] = None,
    replace: Annotated[
        bool, typer.Option("--replace", help="Publish over a checkpoint of the same name (a new version).")
    ] = False,
) -> None:
    """Validate CHECKPOINT, then store it whole as runs/RUN/incoming/NAME (the watcher ignores plain copies)."""
    if not checkpoint.is_dir():
        raise UsageError(f"CHECKPOINT {checkpoint}: not a folder — give the folder save_pretrained wrote")
    from symfuse.store import ArtifactStore, layout

    name = name or dataset or checkpoint.resolve().name
    try:
        key = layout.incoming_key(run, name)
        if dataset is not None:
            layout.check_segment(dataset, "--dataset")
    except ValueError as exc:
        raise UsageError(f"{exc}; pick another --run / --name / --dataset") from exc
    from symfuse.checkpoint import validate_checkpoint

    validate_checkpoint(checkpoint)  # config, headers, shapes, NaN / inf: before anything is uploaded
    store = ArtifactStore(store_root)
    if store.exists(key) and not replace:
        raise OutputExistsError(
            f"{store.uri(key)} exists; pass --replace to publish a new version of it, or another --name"
        )
    uri = store.put_dir(key, checkpoint, "symfuse drop", meta={"dataset": dataset or name})
    typer.echo(f"dropped {checkpoint} as {uri} (dataset {dataset or name}); the next watch-checkpoints tick of run "
               f"{run!r} emits it for a re-merge")  # fmt: skip
