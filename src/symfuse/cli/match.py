"""``symfuse match`` and ``symfuse disguise``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from symfuse.cli import app, checks
from symfuse.config import DATASET_RESOLUTION
from symfuse.errors import UsageError
from symfuse.match.align import OT_KINDS, align_checkpoints, plan_alignment  # no torch until a driver runs
from symfuse.outputs import claim_output
from symfuse.symmetry.registry import kind_names  # no torch: names are checked before it loads

# OT fusion from the command line aligns the whole model, residual stream included (symfuse.match.ot_checkpoints):
# the registered kinds ot / ot-soft (weights), and their activation-based forms, known to the alignment plan only.
OT_ACTS = tuple(k for k in OT_KINDS if "acts" in k)
VERIFY_MODES = ("stream", "full", "none")  # symfuse.match.output_check.VERIFY_MODES (checked before torch is imported)
RANDOM_PIXELS = "random-pixels"  # symfuse.match.activation.RANDOM_PIXELS (named before torch is imported)

MAX_REFINE = 10_000  # match --refine: steps, each a forward and backward pass of the merged model over the data
MAX_NOISE = 100.0  # disguise --noise: relative to each tensor's scale; far above it only overflows


@app.command()
def match(
    source: Annotated[str, typer.Argument(help="Model to align (folder, 'minilm' or hub id).")],
    anchor: Annotated[str, typer.Argument(help="Model to align it to (same family and shapes).")],
    out: Annotated[Path, typer.Option("--out", help="Output folder (must not exist unless --overwrite).")],
    symmetries: Annotated[
        str,
        typer.Option(
            "--symmetries",
            help=f"Comma-separated: {', '.join(kind_names('activations'))} (some need --data). OT fusion (soft "
            f"alignment of heads, FFN units and the residual stream, exact only where the plan is a permutation): "
            f"one of {', '.join(OT_KINDS)} (*-acts: from activations, need --data), optionally with rotation, "
            "scaling.",
        ),
    ] = "rotation,scaling,ffn-permutation",
    workers: Annotated[int | None, typer.Option("--workers", help="Modules matched in parallel.")] = None,
    # --- activation-based matching (issue 5) ---
    data: Annotated[
        str | None,
        typer.Option(
            "--data",
            help="Dataset whose texts feed both models: activation-based permutations (pixel families such as "
            "ViT and CLIP: 'random-pixels'). " + DATASET_RESOLUTION,
        ),
    ] = None,
    max_examples: Annotated[
        int | None, typer.Option("--max-examples", help="Examples of --data for the statistics [512].")
    ] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing --out (at the end).")] = False,
    verify: Annotated[
        str,
        typer.Option(
            "--verify",
            help="Output check of the written folder, reloaded, before publishing: stream (default: both models' "
            "outputs on a few short inputs, one layer in memory at a time), full (both models loaded whole) or none "
            "(the report then says verified: false). Every module's transform is checked while it is applied; "
            "--data, OT and residual-orthogonal hold both models whole and check in full.",
        ),
    ] = "stream",
    device: Annotated[str, typer.Option("--device", help=checks.DEVICE_HELP)] = "auto",
    refine: Annotated[
        int,
        typer.Option(
            "--refine",
            help="residual-orthogonal: steps of learned refinement of the stream map on --data (the merged "
            f"model's loss; the aligned model stays exact; 0 .. {MAX_REFINE}).",
        ),
    ] = 0,
) -> None:
    """Align SOURCE to ANCHOR by exact symmetries; write OUT (checkpoint, transforms, report) and print the report.

    With --data, permutations (residual-permutation, head-permutation, ffn-permutation) come from activation
    correlations on the dataset's texts; rotation and scaling are then fitted on the weights.
    """
    checks.at_least("--workers", workers, 1)
    if max_examples is not None and data is None:  # accepted and ignored before
        raise UsageError("--max-examples: limits --data's examples — add --data DATASET, or drop it")
    max_examples = 512 if max_examples is None else max_examples
    checks.at_least("--max-examples", max_examples, 1)
    checks.at_least("--refine", refine, 0)
    checks.at_most("--refine", refine, MAX_REFINE, "100")  # 10^12 steps ran on without end
    checks.local_path("SOURCE", source)
    checks.local_path("ANCHOR", anchor)
    if verify not in VERIFY_MODES:
        raise UsageError(f"--verify: {verify!r} is not a mode — give one of {', '.join(VERIFY_MODES)}")
    names = checks.names_list("--symmetries", symmetries, (*kind_names("activations"), *OT_ACTS), "symmetries")
    plan_alignment(names, data, refine)  # one line for what does not combine, before any model is read
    checks.checkpoint(source)
    checks.checkpoint(anchor)
    from symfuse.data.vocab import check_same_vocabulary  # loads torch: after the options are checked

    check_same_vocabulary([anchor, source], "matching pairs the models' embedding rows and feeds both the same ids")
    if data is not None and data != RANDOM_PIXELS:  # pixel families' seeded random images are no dataset
        checks.dataset("--data", data, texts=not refine)  # activations read texts; --refine the labels too
        if refine:  # its task loss runs the heads on the data: a task they cannot score failed in torch
            checks.head_reads("--data", data, source)
    device = checks.device("--device", device)
    with claim_output(out, overwrite):
        report = align_checkpoints(source, anchor, out, names, data, max_examples=max_examples, refine=refine,
                                   workers=workers, verify=verify, device=device, overwrite=overwrite)  # fmt: skip
    summary = {k: v for k, v in report.items() if k != "per_module"}
    typer.echo(json.dumps(summary, indent=2))
    typer.echo(f"per-module report and transforms in {out}")


@app.command()
def disguise(
    source: Annotated[str, typer.Argument(help="Model to disguise (folder, 'minilm' or hub id).")],
    out: Annotated[Path, typer.Option("--out", help="Output folder (must not exist unless --overwrite).")],
    seed: Annotated[int, typer.Option("--seed", help="Random seed.")] = 0,
    noise: Annotated[
        float, typer.Option("--noise", help=f"Relative noise on module tensors (0 .. {MAX_NOISE:g}).")
    ] = 0.0,
    kinds: Annotated[
        str,
        typer.Option(
            "--kinds",
            help=f"Comma-separated: {', '.join(kind_names('draw'))}.",
        ),
    ] = "rotation,scaling,ffn-permutation,head-permutation",
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing --out (at the end).")] = False,
    device: Annotated[str, typer.Option("--device", help=checks.DEVICE_HELP)] = "auto",
) -> None:
    """Apply random exact symmetry transforms to SOURCE (same function, different weights).

    --kinds picks them (default: every per-module kind); residual-permutation permutes the whole residual stream
    (it holds the model in memory) and is undone by `symfuse match --symmetries residual-permutation --data ...`.
    """
    checks.finite("--noise", noise)
    checks.at_most("--noise", noise, MAX_NOISE, "0.01")  # 1e40 overflowed float32 into inf weights, exit 0
    checks.seed("--seed", seed)
    names = checks.kinds("--kinds", kinds, "draw", "kinds")
    if noise < 0:
        raise UsageError(f"--noise: {noise} is negative — give a relative noise >= 0 (0 keeps the function exactly)")
    checks.local_path("SOURCE", source)
    checks.checkpoint(source)
    device = checks.device("--device", device)
    with claim_output(out, overwrite):
        from symfuse.match import disguise_checkpoint

        disguise_checkpoint(source, out, seed=seed, noise=noise, kinds=names, overwrite=overwrite, device=device)
    typer.echo(f"wrote disguised copy of {source} to {out}")
