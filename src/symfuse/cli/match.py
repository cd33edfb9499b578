"""``symfuse match`` and ``symfuse disguise``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from symfuse.cli import app
from symfuse.config import DATASET_RESOLUTION
from symfuse.errors import SymfuseError


def _fail(exc: Exception) -> None:
    typer.echo(f"error: {exc}".splitlines()[0], err=True)
    raise typer.Exit(2)


@app.command()
def match(
    source: Annotated[str, typer.Argument(help="Model to align (folder, 'minilm' or hub id).")],
    anchor: Annotated[str, typer.Argument(help="Model to align it to (same family and shapes).")],
    out: Annotated[Path, typer.Option("--out", help="Output folder (must not exist).")],
    symmetries: Annotated[
        str,
        typer.Option(
            "--symmetries", help="Comma-separated: rotation, scaling, ffn-/head-permutation, residual-permutation."
        ),
    ] = "rotation,scaling,ffn-permutation",
    workers: Annotated[int | None, typer.Option("--workers", help="Modules matched in parallel.")] = None,
    # --- activation-based matching (issue 5) ---
    data: Annotated[
        str | None,
        typer.Option(
            "--data", help="Dataset whose texts feed both models: activation-based permutations. " + DATASET_RESOLUTION
        ),
    ] = None,
    max_examples: Annotated[int, typer.Option("--max-examples", help="Examples for the statistics.")] = 512,
) -> None:
    """Align SOURCE to ANCHOR by exact symmetries; write OUT (checkpoint, transforms, report) and print the report.

    With --data, permutations (residual-permutation, head-permutation, ffn-permutation) come from activation
    correlations on the dataset's texts; rotation and scaling are then fitted on the weights.
    """
    from symfuse.match import match_checkpoints

    names = [s.strip() for s in symmetries.split(",") if s.strip()]
    try:
        if data is not None or "residual-permutation" in names:
            if data is None:
                raise ValueError("residual-permutation is found from activations: give --data DATASET")
            from symfuse.match.activation import match_activation_checkpoints

            report = match_activation_checkpoints(source, anchor, out, data, names, max_examples)
        else:
            report = match_checkpoints(source, anchor, out, symmetries=names, workers=workers)
    except (SymfuseError, ValueError, FileExistsError, OSError) as exc:
        _fail(exc)
        return
    summary = {k: v for k, v in report.items() if k != "per_module"}
    typer.echo(json.dumps(summary, indent=2))
    typer.echo(f"per-module report and transforms in {out}")


@app.command()
def disguise(
    source: Annotated[str, typer.Argument(help="Model to disguise (folder, 'minilm' or hub id).")],
    out: Annotated[Path, typer.Option("--out", help="Output folder (must not exist).")],
    seed: Annotated[int, typer.Option("--seed", help="Random seed.")] = 0,
    noise: Annotated[float, typer.Option("--noise", help="Relative noise on module tensors.")] = 0.0,
) -> None:
    """Apply random exact symmetry transforms of every kind to SOURCE (same function, different weights)."""
    from symfuse.match import disguise_checkpoint

    try:
        disguise_checkpoint(source, out, seed=seed, noise=noise)
    except (SymfuseError, ValueError, FileExistsError, OSError) as exc:
        _fail(exc)
        return
    typer.echo(f"wrote disguised copy of {source} to {out}")
