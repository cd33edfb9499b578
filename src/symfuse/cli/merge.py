"""``symfuse merge``: merge K checkpoints with a registered strategy."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from symfuse.cli import app, checks
from symfuse.errors import UsageError
from symfuse.outputs import claim_output


@app.command(cls=checks.multi_value_command("--models", "--stats", "--weights", "--data"))
def merge(
    out_arg: Annotated[Path | None, typer.Argument(metavar="[OUT]", help="Output folder (or --out OUT).")] = None,
    config: Annotated[
        Path | None,
        typer.Option("--config", help="Merge YAML (strategy, models, stats, base, weights, params); see README."),
    ] = None,
    strategy: Annotated[
        str | None, typer.Option("--strategy", help="simple|fisher|regmean|regmean++|task-arithmetic|ties|dare")
    ] = None,
    out: Annotated[
        Path | None, typer.Option("--out", help="Output save_pretrained folder (new unless --overwrite).")
    ] = None,
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
    data: Annotated[
        list[str] | None,
        typer.Option("--data", metavar="DA DB [...]", help="regmean++: each model's own dataset, in model order."),
    ] = None,
    max_examples: Annotated[
        int | None, typer.Option("--max-examples", help="regmean++: examples per dataset for its Grams (256).")
    ] = None,
    device: Annotated[str | None, typer.Option("--device", help="regmean++: forward passes on cpu|cuda.")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing --out (at the end).")] = False,
) -> None:
    """Merge models: --models A B [C ...] [--stats SA SB ...] [--weights wA wB ...] --out OUT.

    Or from one YAML file: `symfuse merge --config merge.yaml OUT`. The file holds everything but the output
    (and --overwrite); flags that it could hold are refused alongside --config rather than silently mixed.
    Writes a save_pretrained folder with symfuse_report.json (strategy, inputs, seconds).
    """
    if out is not None and out_arg is not None:
        raise UsageError(f"OUT: given twice ({out_arg} and --out {out}) — give the output folder once")
    out = out if out is not None else out_arg
    if out is None:
        raise UsageError("--out: missing — give the output folder: --out OUT (or OUT after --config FILE)")
    if config is not None:
        flags = {"--strategy": strategy, "--models": models, "--stats": stats, "--weights": weights, "--base": base}
        flags |= {"--alpha": alpha, "--lam": lam, "--density": density, "--drop": drop, "--combine": combine}
        flags |= {"--seed": seed, "--dtype": dtype, "--epsilon": epsilon, "--data": data}
        flags |= {"--max-examples": max_examples, "--device": device}
        clash = [k for k, v in flags.items() if v is not None and v != []]
        if clash:
            raise UsageError(
                f"{', '.join(clash)}: given with --config — put it in {config}, or drop --config and use flags only"
            )
        from symfuse.merge_config import load_merge_file

        mf = load_merge_file(config)
        strategy, models, base, weights = mf.strategy, mf.models, mf.base, mf.weights
        stats = [Path(s) for s in mf.stats] if mf.stats is not None else None
        p = mf.params
        alpha, lam, density, drop, combine, seed, dtype, epsilon = (
            p.alpha, p.lam, p.density, p.drop, p.combine, p.seed, p.dtype, p.epsilon
        )  # fmt: skip
        data, max_examples, device = p.data, p.max_examples, p.device
    if strategy is None:
        raise UsageError("--strategy: missing — give --strategy NAME, or --config merge.yaml")
    models = list(models or [])
    try:
        params = _validate(strategy, models, stats, weights, base, alpha, lam, density, drop, combine, seed, dtype,
                           epsilon, {"data": data or None, "max_examples": max_examples, "device": device})  # fmt: skip
    except UsageError as exc:
        if config is None:
            raise
        # the shared checks name the flag; in a file it is the key of the same name (params.<flag> for parameters)
        raise UsageError(f"{config}: {exc}") from exc
    from symfuse.merge import merge_checkpoints

    with claim_output(out, overwrite):
        path = merge_checkpoints(strategy, models, out, stats=stats, base=base, overwrite=overwrite, **params)
    report = json.loads((path / "symfuse_report.json").read_text())
    typer.echo(f"{path} ({strategy}, {report['seconds']} s)")


def _validate(
    strategy: str,
    models: list[str],
    stats: list[Path] | None,
    weights: list[float] | None,
    base: str | None,
    alpha: float | None,
    lam: float | None,
    density: float | None,
    drop: float | None,
    combine: str | None,
    seed: int | None,
    dtype: str | None,
    epsilon: float | None,
    sampling: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Every check of the merge's inputs (cheap ones before torch is imported); return the strategy's params.

    ``sampling``: the options of strategies that read the models' data (``data``, ``max_examples``, ``device``).
    """
    # checks that need no registry first: a bad value fails before torch is even imported
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
        **(sampling or {}),
    }
    data = given.get("data")
    checks.fraction("--alpha", alpha, closed_low=True)
    checks.finite("--lam", lam)
    checks.fraction("--density", density)
    if drop is not None and not (0 <= drop < 1):
        raise UsageError(f"--drop: {drop} is outside [0, 1) — give a drop rate such as 0.9")
    checks.one_of("--combine", combine, ("task-arithmetic", "ties"))
    checks.one_of("--dtype", dtype, ("float64", "float32"))
    checks.positive("--epsilon", epsilon)
    checks.at_least("--max-examples", given.get("max_examples"), 1)
    if given.get("device") is not None:
        checks.device("--device", given["device"])
    if weights:
        if len(weights) != len(models):
            raise UsageError(f"--weights: {len(weights)} weight(s) for {len(models)} models — give one per model")
        if not all(w >= 0 and w < float("inf") for w in weights) or sum(weights) <= 0:
            raise UsageError(f"--weights: {weights} — give finite weights >= 0 with a positive sum")
    for m in models:
        checks.local_path("--models", m)
    if base is not None:
        checks.local_path("--base", base)
    from symfuse.merge import MERGERS

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
    needs_data = getattr(merger, "needs_data", False)
    if needs_data and not data:
        raise UsageError(
            f"--data: --strategy {strategy} collects its Grams on each model's own data — give one dataset per "
            "model: --data DA DB [...]"
        )
    if data and len(data) != len(models):
        raise UsageError(f"--data: {len(data)} dataset(s) for {len(models)} models — give one per model, in order")
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
    for d in data or []:
        checks.dataset("--data", d)
    return {k: v for k, v in given.items() if v is not None}
