"""``symfuse stats``: collect Gram / Fisher statistics of a checkpoint on a dataset."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from symfuse.cli import app, checks
from symfuse.cli.bars import terminal_bars
from symfuse.config import DATASET_RESOLUTION
from symfuse.errors import UsageError
from symfuse.outputs import atomic_output_dir


@app.command()
def stats(
    model: Annotated[str, typer.Argument(help="Checkpoint folder (or 'minilm' / hub id).")],
    data: Annotated[str, typer.Option("--data", help=DATASET_RESOLUTION)],
    out: Annotated[Path, typer.Option("--out", help="Output folder (<kind>.safetensors; new unless --overwrite).")],
    kind: Annotated[str, typer.Option("--kind", help="Comma-separated kinds: gram,fisher.")] = "gram",
    max_examples: Annotated[int | None, typer.Option("--max-examples", help="Seeded subset size.")] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Examples per batch.")] = 16,
    split: Annotated[str, typer.Option("--split", help="Dataset split to read.")] = "train",
    max_length: Annotated[int, typer.Option("--max-length", help="Tokens per example at most.")] = 128,
    fisher_mode: Annotated[str, typer.Option("--fisher-mode", help="empirical or sampled.")] = "empirical",
    device: Annotated[str, typer.Option("--device", help=checks.DEVICE_HELP)] = "auto",
    gram_dtype: Annotated[
        str,
        typer.Option(
            "--gram-dtype",
            help="How Grams are stored: float64, or float32 (half the size; for float32 RegMean merges).",
        ),
    ] = "float64",
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing --out (at the end).")] = False,
) -> None:
    """Collect per-layer input Grams and/or diagonal Fisher of MODEL on DATASET."""
    checks.at_least("--max-examples", max_examples, 1)
    checks.at_least("--batch-size", batch_size, 1)
    checks.at_least("--max-length", max_length, 2)
    checks.one_of("--fisher-mode", fisher_mode, ("empirical", "sampled"))
    checks.one_of("--gram-dtype", gram_dtype, ("float64", "float32"))
    device = checks.device("--device", device)
    checks.local_path("MODEL", model)
    from symfuse.stats import collect_stats
    from symfuse.stats.io import STAT_KINDS

    kinds = checks.names_list("--kind", kind, STAT_KINDS, "statistics kinds")
    for option, value, default, needs in (("--fisher-mode", fisher_mode, "empirical", "fisher"),
                                          ("--gram-dtype", gram_dtype, "float64", "gram")):  # fmt: skip
        if value != default and needs not in kinds:  # accepted and ignored, the user would get other statistics
            raise UsageError(f"{option}: only read with --kind {needs} — add {needs} to --kind, or drop {option}")
    checks.checkpoint(model, arch=False)
    with terminal_bars(), atomic_output_dir(out, overwrite=overwrite, inputs=[model, data]) as tmp:
        checks.dataset("--data", data, split)
        if "fisher" in kinds and fisher_mode == "empirical":  # the data's targets go through the head
            checks.head_reads("--data", data, model)
        written = collect_stats(
            model,
            data,
            kinds,
            tmp,
            max_examples=max_examples,
            batch_size=batch_size,
            device=device,
            split=split,
            max_length=max_length,
            fisher_mode=fisher_mode,
            gram_dtype=gram_dtype,
        )
    for k, path in written.items():
        typer.echo(f"{k}: {Path(out) / path.name}")
