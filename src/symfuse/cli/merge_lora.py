"""``symfuse merge-lora``: merge K PEFT LoRA adapters of one base into one adapter (or into the base)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from symfuse.cli import app, checks
from symfuse.cli.merge import _param_options
from symfuse.errors import UsageError
from symfuse.merge.registry import MERGERS, merger_params  # no torch: names only
from symfuse.outputs import claim_output

BASES = ("aligned", "full", "naive")  # symfuse.lora.bases.BASES (not imported: it imports torch)
ADAPTER_CONFIG = "adapter_config.json"


@app.command("merge-lora", cls=checks.multi_value_command("--adapters", "--weights"))
def merge_lora(
    out_arg: Annotated[Path | None, typer.Argument(metavar="[OUT]", help="Output folder (or --out OUT).")] = None,
    adapters: Annotated[
        list[str] | None,
        typer.Option("--adapters", metavar="A [B ...]", help="PEFT adapter folders of one base (one or more)."),
    ] = None,
    strategy: Annotated[
        str, typer.Option("--strategy", help="A strategy without statistics (simple, task-arithmetic, ties, ...).")
    ] = "task-arithmetic",
    basis: Annotated[
        str,
        typer.Option(
            "--basis",
            help="aligned: KnOTS's shared SVD basis; full: the updates B A themselves; naive: A's and B's "
            "separately (PEFT's way; depends on the factors' basis).",
        ),
    ] = "aligned",
    weights: Annotated[
        list[float] | None, typer.Option("--weights", metavar="wA [wB ...]", help="One weight per adapter (>= 0).")
    ] = None,
    rank: Annotated[
        int | None, typer.Option("--rank", help="Output rank (default: the largest sum of a module's ranks).")
    ] = None,
    base: Annotated[
        str | None, typer.Option("--base", help="Base checkpoint: needed for DoRA adapters and --into-base.")
    ] = None,
    into_base: Annotated[
        bool, typer.Option("--into-base", help="Write the base with the merged update applied (a full checkpoint).")
    ] = False,
    param: Annotated[
        list[str] | None,
        typer.Option("--param", metavar="NAME=VALUE", help="Any parameter of the strategy (repeat for several)."),
    ] = None,
    lam: Annotated[float | None, typer.Option("--lam", help="Task-vector scale.")] = None,
    density: Annotated[
        float | None, typer.Option("--density", help="TIES: fraction kept, in (0, 1] (DARE: --param drop=P).")
    ] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Output folder (new unless --overwrite).")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing --out (at the end).")] = False,
    device: Annotated[str, typer.Option("--device", help=checks.DEVICE_HELP)] = "auto",
) -> None:
    """Merge LoRA adapters: --adapters A [B ...] --strategy S [--basis aligned] --out OUT.

    Writes a PEFT adapter folder (plain LoRA, or DoRA for DoRA inputs; rank --rank, scale 1) with
    symfuse_report.json (strategy, basis, rank, each module's truncation error), or with --into-base the base
    checkpoint with the merged update applied. One adapter with weight 1 and a linear strategy gives back its update.
    Classifier adapters (modules_to_save) keep their heads: the first in OUT, each other in OUT/heads/<name>/.
    """
    if out is not None and out_arg is not None:
        raise UsageError(f"OUT: given twice ({out_arg} and --out {out}) — give the output folder once")
    out = out if out is not None else out_arg
    if out is None:
        raise UsageError("--out: missing — give the output folder: --out OUT")
    given = {k: (v, f"--{k}") for k, v in {"lam": lam, "density": density}.items() if v is not None}
    given |= _param_options(param or [], {"lam": lam, "density": density})
    params = _check(adapters or [], strategy, basis, weights, rank, base, into_base, given)
    dev = checks.device("--device", device)
    from symfuse.lora import merge_adapters

    with claim_output(out, overwrite):
        path = merge_adapters(adapters or [], out, strategy, basis=basis, rank=rank, base=base, into_base=into_base,
                              overwrite=overwrite, device=dev, **params)  # fmt: skip
    report = json.loads((path / "symfuse_report.json").read_text())
    err = report["truncation"]["max_relative_error"]
    typer.echo(f"{path} ({strategy}, {basis} basis, {report['output']}, truncation error {err:.2e}, "
               f"{report['seconds']} s)")  # fmt: skip
    for head in report["heads"][1:]:  # the first adapter's head is in the output itself
        typer.echo(f"  with {head['adapter']}'s head: {path / head['folder']}")


def _check(
    adapters: list[str],
    strategy: str,
    basis: str,
    weights: list[float] | None,
    rank: int | None,
    base: str | None,
    into_base: bool,
    given: dict,
) -> dict:
    """The cheap checks (before torch); returns the strategy's parameters."""
    if not adapters:
        raise UsageError("--adapters: none given — give one or more PEFT adapter folders: --adapters A [B ...]")
    checks.distinct("--adapters", adapters, "adapter")
    checks.one_of("--basis", basis, BASES)
    checks.one_of("--strategy", strategy, MERGERS.names())
    if weights is not None and len(weights) != len(adapters):
        raise UsageError(f"--weights: {len(weights)} weight(s) for {len(adapters)} adapters — give one per adapter")
    if weights is not None and (not all(0 <= w < float("inf") for w in weights) or sum(weights) <= 0):
        raise UsageError(f"--weights: {weights} — give finite weights >= 0 with a positive sum")
    if rank is not None and into_base:
        raise UsageError("--rank: given with --into-base — a full checkpoint is not truncated; drop --rank")
    checks.at_least("--rank", rank, 1)
    if into_base and base is None:
        raise UsageError("--into-base: no --base — give the base checkpoint with --base BASE")
    for a in adapters:
        checks.local_path("--adapters", a)
        if not (Path(a) / ADAPTER_CONFIG).is_file():
            raise UsageError(
                f"--adapters: {a} has no {ADAPTER_CONFIG} — not a PEFT adapter folder; merge full checkpoints with "
                "symfuse merge"
            )
    if base is not None:
        checks.local_path("--base", base)
    labels = {k: label for k, (_, label) in given.items()}
    values = {k: v for k, (v, _) in given.items()} | ({"weights": weights} if weights else {})
    try:
        merger_params(strategy, values, label=lambda k: labels.get(k, "--weights" if k == "weights" else k))
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    return values
