"""``symfuse inspect``: will alignment help, will this merge work? One table (or JSON, or a PNG) before any merge."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from symfuse.cli import app, checks
from symfuse.config import DATASET_RESOLUTION
from symfuse.errors import DataError, OutputExistsError, UsageError
from symfuse.inspect.verdict import THRESHOLDS_HELP  # no torch: --help reads it

MAX_EXAMPLES, SPLIT = 64, "test"  # what --data reads by default
RESIDUAL_ITERS = 2  # rounds of the residual-orthogonal search (pre-norm families)


@app.command("inspect")
def inspect_command(
    models: Annotated[
        list[str], typer.Argument(help="Two or more checkpoint folders of one family; the first is the anchor.")
    ],
    data: Annotated[
        str | None,
        typer.Option(
            "--data",
            help="Dataset for the loss along the path (λ = 0, 0.25, 0.5, 0.75, 1) before and after alignment and "
            "the merge-vs-ensemble gap (task heads: their loss; causal LMs: next-token loss). " + DATASET_RESOLUTION,
        ),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the report as one JSON mapping (verdict, reason, figures).")
    ] = False,
    out: Annotated[Path | None, typer.Option("--out", help="Also draw the report as a PNG file.")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing --out.")] = False,
    residual_iters: Annotated[
        int | None,
        typer.Option(
            "--residual-iters",
            help="Rounds of the whole-model residual-orthogonal search (pre-norm families: gpt2, llama, qwen3, phi3, "
            f"vit; post-LN families have none); 0 skips it. Default {RESIDUAL_ITERS}.",
        ),
    ] = None,
    max_examples: Annotated[int, typer.Option("--max-examples", help="Examples read with --data.")] = MAX_EXAMPLES,
    split: Annotated[str, typer.Option("--split", help="Split read with --data.")] = SPLIT,
    device: Annotated[str, typer.Option("--device", help=checks.DEVICE_HELP)] = "auto",
) -> None:
    """Will alignment help, will this merge work? Every model against the first, then a verdict.

    Family and shapes, the weight distance before and after each symmetry kind, with --data the loss barrier and
    the merge-vs-ensemble gap. Verdicts:
    """
    checks.at_least("--residual-iters", residual_iters, 0)
    checks.at_least("--max-examples", max_examples, 1)
    if len(models) < 2:
        raise UsageError("MODELS: inspect compares models with the first — give at least two checkpoint folders")
    for m in models:
        checks.local_path("MODEL", m)
        checks.checkpoint(m)
    if data is None and (split != SPLIT or max_examples != MAX_EXAMPLES):
        option = "--split" if split != SPLIT else "--max-examples"
        raise UsageError(f"{option}: only read with --data — give --data DATASET, or drop {option}")
    _check_families(models, residual_iters)
    if out is not None:
        _check_png(out, overwrite)
    if data is not None and not checks.scored_dataset("--data", data, split):
        for m in models:  # a regression set on classifiers failed inside the loss path's forward pass
            checks.head_reads("--data", data, m)
    device = checks.device("--device", device)
    from symfuse.inspect import inspect_models
    from symfuse.inspect.render import format_report, plot_report

    iters = RESIDUAL_ITERS if residual_iters is None else residual_iters
    report = inspect_models(models, data, residual_iters=iters, device=device, max_examples=max_examples,
                            split=split)  # fmt: skip
    if out is not None:
        report["figure"] = str(plot_report(report, out))
    typer.echo(json.dumps(report, indent=2) if as_json else format_report(report))


inspect_command.__doc__ = (inspect_command.__doc__ or "").rstrip() + " " + THRESHOLDS_HELP


def _check_families(models: list[str], residual_iters: int | None) -> None:
    """Models of another family than the anchor's are a bad input: one line, exit 1.

    So is ``--residual-iters N`` for a family without the residual search (accepted and ignored, it read as done).
    """
    from symfuse.checkpoint import CheckpointReader

    with CheckpointReader(models[0]) as anchor:
        family = anchor.spec.family
        if residual_iters:
            from symfuse.inspect.distances import has_residual_search  # the maths: loaded only when asked

            if not has_residual_search(anchor):
                raise UsageError(
                    f"--residual-iters: {family} models have no residual-orthogonal search (post-LN: its norms are "
                    "not equivariant to a stream rotation) — drop --residual-iters"
                )
    for m in models[1:]:
        with CheckpointReader(m) as reader:
            if reader.spec.family != family:
                raise DataError(
                    f"{m}: a {reader.spec.family} model, the anchor {models[0]} a {family} model — incompatible: "
                    "models of different families cannot be aligned or merged; inspect models of one family"
                )


def _check_png(out: Path, overwrite: bool) -> None:
    if out.suffix.lower() not in (".png", ""):
        raise UsageError(f"--out: {out} — inspect draws a PNG image; name the file .png")
    if out.is_dir():
        raise UsageError(f"--out: {out} is a folder — give the PNG file to write")
    if out.exists() and not overwrite:
        raise OutputExistsError(f"{out}: already exists — pass --overwrite to replace it, or choose another --out")
    if out.exists():
        with out.open("rb") as f:
            if f.read(8) != b"\x89PNG\r\n\x1a\n":
                raise OutputExistsError(f"{out}: exists and is not a PNG image — --overwrite replaces only a PNG file")
    if not out.parent.is_dir():
        raise UsageError(f"--out: {out.parent} is not a folder — create it or choose another --out")
    checks.writable_file("--out", out)
