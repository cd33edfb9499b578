"""``symfuse evaluate`` and ``symfuse barrier``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from symfuse.cli import app
from symfuse.config import DATASET_RESOLUTION


@app.command()
def evaluate(
    model: Annotated[str, typer.Argument(help="Checkpoint folder with a task head.")],
    data: Annotated[str, typer.Option("--data", help=DATASET_RESOLUTION)],
    split: Annotated[str, typer.Option("--split")] = "test",
    labels_from: Annotated[str | None, typer.Option("--labels-from", help="Dataset naming the head's outputs.")] = None,
    max_examples: Annotated[int | None, typer.Option("--max-examples")] = None,
    max_length: Annotated[int, typer.Option("--max-length")] = 128,
    batch_size: Annotated[int, typer.Option("--batch-size")] = 64,
    out: Annotated[
        Path | None, typer.Option("--out", help="Metrics JSON (default <model>/eval_<data>_<split>.json).")
    ] = None,
    device: Annotated[str, typer.Option("--device")] = "cpu",
) -> None:
    """Evaluate MODEL on a dataset split; print and write the metrics JSON."""
    from symfuse.evaluate import evaluate_model

    metrics = evaluate_model(
        model,
        data,
        split=split,
        labels_from=labels_from,
        max_examples=max_examples,
        device=device,
        batch_size=batch_size,
        max_length=max_length,
        out_file=out,
    )
    typer.echo(json.dumps(metrics, indent=2))


@app.command()
def barrier(
    a: Annotated[str, typer.Argument(help="First model (λ = 0).")],
    b: Annotated[str, typer.Argument(help="Second model (λ = 1), same architecture and head shape.")],
    data: Annotated[str, typer.Option("--data", help=DATASET_RESOLUTION)],
    out: Annotated[Path, typer.Option("--out", help="Folder for barrier.json and barrier.png.")],
    points: Annotated[int, typer.Option("--points")] = 21,
    split: Annotated[str, typer.Option("--split")] = "test",
    max_examples: Annotated[int | None, typer.Option("--max-examples")] = None,
    max_length: Annotated[int, typer.Option("--max-length")] = 128,
    device: Annotated[str, typer.Option("--device")] = "cpu",
) -> None:
    """Loss barrier along (1-λ)θ_A + λθ_B on a dataset split."""
    from symfuse.evaluate import loss_barrier

    r = loss_barrier(
        a, b, data, out, points=points, split=split, max_examples=max_examples, max_length=max_length, device=device
    )
    for lam, loss in zip(r["lambdas"], r["losses"], strict=True):
        typer.echo(f"λ={lam:.2f}  loss={loss:.5f}")
    typer.echo(f"barrier {r['barrier']:.5f} at λ={r['argmax_lambda']:.2f}; wrote {out}/barrier.json, barrier.png")
