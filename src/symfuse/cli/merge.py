"""``symfuse merge``: merge K checkpoints with a registered strategy."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from symfuse.cli import app, checks
from symfuse.errors import UsageError
from symfuse.outputs import claim_output


@app.command(cls=checks.multi_value_command("--models", "--stats", "--weights"))
def merge(
    strategy: Annotated[str, typer.Option("--strategy", help="simple|fisher|regmean|task-arithmetic|ties|dare")],
    out: Annotated[Path, typer.Option("--out", help="Output save_pretrained folder (new unless --overwrite).")],
    models: Annotated[
        list[str] | None, typer.Option("--models", metavar="A B [C ...]", help="Checkpoints to merge (two or more).")
    ] = None,
    stats: Annotated[
        list[Path] | None,
        typer.Option("--stats", metavar="SA SB [...]", help="One statistics folder (or file) per model, in order."),
    ] = None,
    weights: Annotated[
        list[float] | None, typer.Option("--weights", metavar="wA wB [...]", help="One weight per model (>= 0).")
    ] = None,
    base: Annotated[str | None, typer.Option("--base", help="Base checkpoint (task vectors).")] = None,
    alpha: Annotated[float | None, typer.Option("--alpha", help="RegMean off-diagonal scale in [0, 1] (0.9).")] = None,
    lam: Annotated[float | None, typer.Option("--lam", help="Task-vector scale.")] = None,
    density: Annotated[float | None, typer.Option("--density", help="TIES: fraction kept, in (0, 1].")] = None,
    drop: Annotated[float | None, typer.Option("--drop", help="DARE drop rate, in [0, 1).")] = None,
    combine: Annotated[str | None, typer.Option("--combine", help="DARE: task-arithmetic or ties.")] = None,
    seed: Annotated[int | None, typer.Option("--seed", help="DARE seed.")] = None,
    dtype: Annotated[str | None, typer.Option("--dtype", help="RegMean precision: float64|float32.")] = None,
    epsilon: Annotated[float | None, typer.Option("--epsilon", help="Fisher floor (> 0).")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing --out (at the end).")] = False,
) -> None:
    """Merge models: --models A B [C ...] [--stats SA SB ...] [--weights wA wB ...] --out OUT.

    Writes a save_pretrained folder with symfuse_report.json (strategy, inputs, seconds).
    """
    # checks that need no registry first: a bad value fails before torch is even imported
    models = list(models or [])
    if len(models) < 2:
        raise UsageError(f"--models: {len(models)} model(s) given — give two or more: --models A B [C ...]")
    given = {
        "alpha": alpha,
        "weights": weights or None,
        "lam": lam,
        "density": density,
        "drop": drop,
        "combine": combine,
        "seed": seed,
        "dtype": dtype,
        "epsilon": epsilon,
    }
    checks.fraction("--alpha", alpha, closed_low=True)
    checks.finite("--lam", lam)
    checks.fraction("--density", density)
    if drop is not None and not (0 <= drop < 1):
        raise UsageError(f"--drop: {drop} is outside [0, 1) — give a drop rate such as 0.9")
    checks.one_of("--combine", combine, ("task-arithmetic", "ties"))
    checks.one_of("--dtype", dtype, ("float64", "float32"))
    checks.positive("--epsilon", epsilon)
    if weights:
        if len(weights) != len(models):
            raise UsageError(f"--weights: {len(weights)} weight(s) for {len(models)} models — give one per model")
        if not all(w >= 0 and w < float("inf") for w in weights) or sum(weights) <= 0:
            raise UsageError(f"--weights: {weights} — give finite weights >= 0 with a positive sum")
    for m in models:
        checks.local_path("--models", m)
    if base is not None:
        checks.local_path("--base", base)
    from symfuse.merge import MERGERS, merge_checkpoints

    checks.one_of("--strategy", strategy, MERGERS)
    merger = MERGERS[strategy]
    checks.unused(strategy, given, merger.Params.model_fields)
    if stats and not merger.required_stats:
        raise UsageError(f"--stats: --strategy {strategy} reads no statistics — drop --stats")
    if merger.required_stats and not stats:
        kinds = ", ".join(sorted(merger.required_stats))
        raise UsageError(f"--stats: --strategy {strategy} needs {kinds} statistics — give one folder per model")
    if stats and len(stats) != len(models):
        raise UsageError(f"--stats: {len(stats)} statistics for {len(models)} models — give one per model, in order")
    if merger.needs_base and base is None:
        raise UsageError(f"--base: --strategy {strategy} works on task vectors — give the base model with --base")
    if base is not None and not merger.needs_base:
        raise UsageError(f"--base: --strategy {strategy} does not use a base model — drop --base")
    for s in stats or []:
        checks.local_path("--stats", s, folder=False)
    for m in [*models, *([base] if base is not None else [])]:
        checks.checkpoint(m)
    if stats:
        checks.stats_files(stats, merger.required_stats)
    params = {k: v for k, v in given.items() if v is not None}
    with claim_output(out, overwrite):
        path = merge_checkpoints(strategy, models, out, stats=stats, base=base, overwrite=overwrite, **params)
    report = json.loads((path / "symfuse_report.json").read_text())
    typer.echo(f"{path} ({strategy}, {report['seconds']} s)")
