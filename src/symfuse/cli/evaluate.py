"""``symfuse evaluate`` and ``symfuse barrier``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from symfuse.cli import app, checks
from symfuse.config import DATASET_RESOLUTION
from symfuse.errors import UsageError
from symfuse.outputs import atomic_output_dir

MAX_POINTS = 1001  # barrier: λ values evaluated, one full pass over the split each


@app.command()
def evaluate(
    model: Annotated[
        str, typer.Argument(help="Checkpoint folder with a task head (a causal LM for language-modelling data).")
    ],
    data: Annotated[str, typer.Option("--data", help=DATASET_RESOLUTION)],
    split: Annotated[str, typer.Option("--split", help="Dataset split to read.")] = "test",
    labels_from: Annotated[str | None, typer.Option("--labels-from", help="Dataset naming the head's outputs.")] = None,
    max_examples: Annotated[
        int | None, typer.Option("--max-examples", help="Examples to use at most (all when absent).")
    ] = None,
    max_length: Annotated[int, typer.Option("--max-length", help="Tokens per example at most.")] = 128,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Examples per batch.")] = 64,
    out: Annotated[
        Path | None, typer.Option("--out", help="Metrics JSON (default <model>/eval_<data>_<split>.json).")
    ] = None,
    device: Annotated[str, typer.Option("--device", help=checks.DEVICE_HELP)] = "auto",
) -> None:
    """Evaluate MODEL on a dataset split; print and write the metrics JSON.

    A language-modelling dataset (meta.json "task": "language_modeling", e.g. tinyshakespeare) scores a causal LM:
    its mean next-token loss and perplexity.
    """
    checks.at_least("--max-examples", max_examples, 1)
    checks.at_least("--max-length", max_length, 2)
    checks.at_least("--batch-size", batch_size, 1)
    device = checks.device("--device", device)
    checks.local_path("MODEL", model)
    checks.checkpoint(model, arch=False)
    checks.metrics_file("--out", out)
    checks.writable_file("--out", out)
    if checks.scored_dataset("--data", data, split):  # a causal LM's perplexity: no labels, no heads
        if labels_from is not None:
            raise UsageError(f"--labels-from: {data} is a language-modelling dataset, without labels — drop it")
    else:
        model = _head_for(model, data)
        checks.head_reads("--data", data, model)
    from symfuse.evaluate import evaluate_model
    from symfuse.outputs import mark_published

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
    mark_published(metrics["metrics_file"])  # whole and in place: an interrupt from here on does not remove it
    typer.echo(json.dumps(metrics, indent=2))


def _head_for(model: str, data: str) -> str:
    """A merged folder's head trained on ``data`` (``heads/<dataset>/``, or the folder itself), said on stderr."""
    from symfuse.data import load_task_dataset

    name = load_task_dataset(data).name
    merged = Path(model) / "symfuse_report.json"
    folder = Path(model) / "heads" / name
    if merged.is_file() and folder.is_dir():
        typer.echo(f"{model}: scoring with the head trained on {name} ({folder})", err=True)
        return str(folder)
    return model


@app.command()
def barrier(
    a: Annotated[str, typer.Argument(help="First model (λ = 0).")],
    b: Annotated[str, typer.Argument(help="Second model (λ = 1), same architecture and head shape.")],
    data: Annotated[str, typer.Option("--data", help=DATASET_RESOLUTION)],
    out: Annotated[Path, typer.Option("--out", help="Folder for barrier.json and barrier.png (new).")],
    points: Annotated[int, typer.Option("--points", help=f"λ values in [0, 1] (2 .. {MAX_POINTS}).")] = 21,
    split: Annotated[str, typer.Option("--split", help="Dataset split to read.")] = "test",
    max_examples: Annotated[
        int | None, typer.Option("--max-examples", help="Examples to use at most (all when absent).")
    ] = None,
    max_length: Annotated[int, typer.Option("--max-length", help="Tokens per example at most.")] = 128,
    device: Annotated[str, typer.Option("--device", help=checks.DEVICE_HELP)] = "auto",
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing --out (at the end).")] = False,
) -> None:
    """Loss barrier along (1-λ)θ_A + λθ_B on a dataset split."""
    checks.at_least("--points", points, 2)
    checks.at_most("--points", points, MAX_POINTS, "21")  # each point evaluates one interpolated model
    checks.at_least("--max-examples", max_examples, 1)
    checks.at_least("--max-length", max_length, 2)
    device = checks.device("--device", device)
    checks.local_path("A", a)
    checks.local_path("B", b)
    checks.checkpoint(a, arch=False)
    checks.checkpoint(b, arch=False)
    if not checks.scored_dataset("--data", data, split):
        checks.head_reads("--data", data, a)
        checks.head_reads("--data", data, b)
    from symfuse.evaluate import loss_barrier

    with atomic_output_dir(out, overwrite=overwrite, inputs=[a, b, data]) as tmp:
        r = loss_barrier(
            a, b, data, tmp, points=points, split=split, max_examples=max_examples, max_length=max_length, device=device
        )
    for lam, loss in zip(r["lambdas"], r["losses"], strict=True):
        typer.echo(f"λ={lam:.2f}  loss={loss:.5f}")
    typer.echo(f"barrier {r['barrier']:.5f} at λ={r['argmax_lambda']:.2f}; wrote {out}/barrier.json, barrier.png")
