"""``symfuse merge``: merge K checkpoints with a registered strategy."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from symfuse.cli import app

# Options that take several space-separated values (``--models A B C``); click has no nargs=-1 options, so the
# command collects them from the raw arguments.
_MULTI = ("--models", "--stats", "--weights")


def _split_multi(args: list[str]) -> dict[str, list[str]]:
    """``{"--models": [...], ...}`` from raw arguments; anything else is an error."""
    found: dict[str, list[str]] = {}
    current = None
    for a in args:
        if a.startswith("--"):
            if a not in _MULTI:
                raise typer.BadParameter(f"unknown option {a}")
            current = a
            found.setdefault(a, [])
        elif current is None:
            raise typer.BadParameter(f"unexpected argument {a!r}")
        else:
            found[current].append(a)
    return found


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def merge(
    ctx: typer.Context,
    strategy: Annotated[str, typer.Option("--strategy", help="simple|fisher|regmean|task-arithmetic|ties|dare")],
    out: Annotated[Path, typer.Option("--out", help="Output save_pretrained folder.")],
    base: Annotated[str | None, typer.Option("--base", help="Base checkpoint (task vectors).")] = None,
    alpha: Annotated[float | None, typer.Option("--alpha", help="RegMean off-diagonal scale (0.9).")] = None,
    lam: Annotated[float | None, typer.Option("--lam", help="Task-vector scale.")] = None,
    density: Annotated[float | None, typer.Option("--density", help="TIES: fraction kept.")] = None,
    drop: Annotated[float | None, typer.Option("--drop", help="DARE drop rate.")] = None,
    combine: Annotated[str | None, typer.Option("--combine", help="DARE: task-arithmetic or ties.")] = None,
    seed: Annotated[int | None, typer.Option("--seed", help="DARE seed.")] = None,
    dtype: Annotated[str | None, typer.Option("--dtype", help="RegMean precision: float64|float32.")] = None,
    epsilon: Annotated[float | None, typer.Option("--epsilon", help="Fisher floor.")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite")] = False,
) -> None:
    """Merge models: --models A B [C ...] [--stats SA SB ...] [--weights wA wB ...] --out OUT.

    Writes a save_pretrained folder with symfuse_report.json (strategy, inputs, seconds).
    """
    from symfuse.merge import merge_checkpoints

    multi = _split_multi(list(ctx.args))
    models = multi.get("--models") or []
    if not models:
        raise typer.BadParameter("give the models to merge: --models A B [C ...]")
    stats = [Path(s) for s in multi.get("--stats", [])] or None
    weights = [float(w) for w in multi.get("--weights", [])] or None
    given = {
        "alpha": alpha,
        "weights": weights,
        "lam": lam,
        "density": density,
        "drop": drop,
        "combine": combine,
        "seed": seed,
        "dtype": dtype,
        "epsilon": epsilon,
    }
    params = {k: v for k, v in given.items() if v is not None}
    path = merge_checkpoints(strategy, models, out, stats=stats, base=base, overwrite=overwrite, **params)
    report = json.loads((path / "symfuse_report.json").read_text())
    typer.echo(f"{path} ({strategy}, {report['seconds']} s)")
