"""``symfuse match`` and ``symfuse disguise``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from symfuse.cli import app, checks
from symfuse.config import DATASET_RESOLUTION
from symfuse.errors import UsageError
from symfuse.outputs import claim_output

# symfuse.match.checkpoints.DISGUISE_KINDS (spelled out: checked before torch is imported)
VERIFY_MODES = ("stream", "full", "none")  # symfuse.match.verify.VERIFY_MODES (checked before torch is imported)
DISGUISE_KINDS = ("rotation", "scaling", "ffn-permutation", "head-permutation", "residual-permutation")


@app.command()
def match(
    source: Annotated[str, typer.Argument(help="Model to align (folder, 'minilm' or hub id).")],
    anchor: Annotated[str, typer.Argument(help="Model to align it to (same family and shapes).")],
    out: Annotated[Path, typer.Option("--out", help="Output folder (must not exist unless --overwrite).")],
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
            "--data",
            help="Dataset whose texts feed both models: activation-based permutations (pixel families such as "
            "ViT: 'random-pixels'). " + DATASET_RESOLUTION,
        ),
    ] = None,
    max_examples: Annotated[int, typer.Option("--max-examples", help="Examples for the statistics.")] = 512,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing --out (at the end).")] = False,
    verify: Annotated[
        str,
        typer.Option(
            "--verify",
            help="Output check before publishing: stream (default: both models' outputs on a few short inputs, "
            "one layer in memory at a time), full (both models loaded whole) or none. Every module's transform is "
            "checked while it is applied in all three (with --data the models already in memory are compared).",
        ),
    ] = "stream",
) -> None:
    """Align SOURCE to ANCHOR by exact symmetries; write OUT (checkpoint, transforms, report) and print the report.

    With --data, permutations (residual-permutation, head-permutation, ffn-permutation) come from activation
    correlations on the dataset's texts; rotation and scaling are then fitted on the weights.
    """
    checks.at_least("--workers", workers, 1)
    checks.at_least("--max-examples", max_examples, 1)
    checks.local_path("SOURCE", source)
    checks.local_path("ANCHOR", anchor)
    from symfuse.match.activation import ACTIVATION_SYMMETRIES

    names = checks.names_list("--symmetries", symmetries, ACTIVATION_SYMMETRIES, "symmetries")
    if verify not in VERIFY_MODES:
        raise UsageError(f"--verify: {verify!r} is not a mode — give one of {', '.join(VERIFY_MODES)}")
    if data is None and "residual-permutation" in names:
        raise UsageError("--symmetries: residual-permutation is found from activations — give --data DATASET")
    checks.checkpoint(source)
    checks.checkpoint(anchor)
    if data is not None:
        checks.dataset("--data", data)
    with claim_output(out, overwrite):
        if data is not None:
            from symfuse.match.activation import match_activation_checkpoints

            report = match_activation_checkpoints(source, anchor, out, data, names, max_examples, overwrite=overwrite)
        else:
            from symfuse.match import match_checkpoints

            report = match_checkpoints(
                source, anchor, out, symmetries=names, workers=workers, overwrite=overwrite, verify=verify
            )
    summary = {k: v for k, v in report.items() if k != "per_module"}
    typer.echo(json.dumps(summary, indent=2))
    typer.echo(f"per-module report and transforms in {out}")


@app.command()
def disguise(
    source: Annotated[str, typer.Argument(help="Model to disguise (folder, 'minilm' or hub id).")],
    out: Annotated[Path, typer.Option("--out", help="Output folder (must not exist unless --overwrite).")],
    seed: Annotated[int, typer.Option("--seed", help="Random seed.")] = 0,
    noise: Annotated[float, typer.Option("--noise", help="Relative noise on module tensors (>= 0).")] = 0.0,
    kinds: Annotated[
        str,
        typer.Option(
            "--kinds",
            help="Comma-separated: rotation, scaling, ffn-permutation, head-permutation, residual-permutation.",
        ),
    ] = "rotation,scaling,ffn-permutation,head-permutation",
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing --out (at the end).")] = False,
) -> None:
    """Apply random exact symmetry transforms to SOURCE (same function, different weights).

    --kinds picks them (default: every per-module kind); residual-permutation permutes the whole residual stream
    (it holds the model in memory) and is undone by `symfuse match --symmetries residual-permutation --data ...`.
    """
    checks.finite("--noise", noise)
    names = checks.names_list("--kinds", kinds, DISGUISE_KINDS, "kinds")
    if noise < 0:
        raise UsageError(f"--noise: {noise} is negative — give a relative noise >= 0 (0 keeps the function exactly)")
    checks.local_path("SOURCE", source)
    checks.checkpoint(source)
    with claim_output(out, overwrite):
        from symfuse.match import disguise_checkpoint

        disguise_checkpoint(source, out, seed=seed, noise=noise, kinds=names, overwrite=overwrite)
    typer.echo(f"wrote disguised copy of {source} to {out}")
