"""``symfuse match-many``: align K models to one anchor (closest, barycenter or a named model) in one run."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated

import typer

from symfuse.cli import app, checks
from symfuse.errors import UsageError
from symfuse.outputs import MARKER, atomic_output_dir, claim_output
from symfuse.symmetry.registry import kind_names  # no torch: names are checked before it loads

REPORT = "symfuse_many_report.json"


def output_names(models: list[str]) -> list[str]:
    """One sub-folder name per model: its folder name, prefixed with its position when two names clash.

    Names that differ only in case clash too: they are one folder on a case-insensitive file system (macOS, Windows).
    """
    base = [Path(m.rstrip("/")).name or f"model{i}" for i, m in enumerate(models)]
    reserved = {REPORT, MARKER}  # files written into OUT beside the models' folders
    if len({b.casefold() for b in base}) == len(base) and not reserved & set(base):
        return base
    return [f"{i}-{b}" for i, b in enumerate(base)]


def _iteration_options(max_iter: int | None, tol: float | None) -> tuple[int, float, list[str]]:
    """``--max-iter`` and ``--tol`` checked (20 and 1e-7 when not given), and the options given."""
    given = [o for o, v in (("--max-iter", max_iter), ("--tol", tol)) if v is not None]
    max_iter, tol = 20 if max_iter is None else max_iter, 1e-7 if tol is None else tol
    checks.at_least("--max-iter", max_iter, 1)
    checks.positive("--tol", tol)
    return max_iter, tol, given


def anchor_index(anchor: str, models: list[str], names: list[str]) -> str | int:
    """``closest`` / ``barycenter`` as given; a model (as written, its output name or folder name) as its index.

    Raises:
        UsageError: ``anchor`` names no model, or names two different models by their folder name.
    """
    if anchor in ("closest", "barycenter"):
        return anchor
    same = os.path.exists(anchor) and [
        i for i, m in enumerate(models) if os.path.exists(m) and os.path.samefile(m, anchor)
    ]
    found = (
        [i for i, m in enumerate(models) if anchor == m]
        or same
        or [i for i, (m, n) in enumerate(zip(models, names, strict=True)) if anchor in (n, Path(m.rstrip("/")).name)]
    )
    if not found:
        raise UsageError(
            f"--anchor: {anchor!r} is not closest, barycenter or one of the models ({', '.join(names)}) — "
            "give closest, barycenter or a model as written on the command line"
        )
    if len({os.path.realpath(models[i]) for i in found}) > 1:
        raise UsageError(
            f"--anchor: {anchor!r} names {len(found)} models ({', '.join(models[i] for i in found)}) — give the "
            f"anchor by its path, e.g. --anchor {models[found[0]]}"
        )
    return found[0]


@app.command("match-many")
def match_many_cmd(
    models_args: Annotated[
        list[str] | None, typer.Argument(metavar="M1 M2 [M3 ...]", help="Models to align (two or more).")
    ] = None,
    out: Annotated[
        Path | None, typer.Option("--out", help="Output folder (must not exist unless --overwrite).")
    ] = None,
    anchor: Annotated[
        str,
        typer.Option(
            "--anchor",
            help="closest (model nearest the plain average), barycenter, or one model: its path, or its folder name "
            "when no other model shares it.",
        ),
    ] = "closest",
    symmetries: Annotated[
        str,
        typer.Option("--symmetries", help=f"Comma-separated: {', '.join(kind_names('weights'))}."),
    ] = "rotation,scaling,ffn-permutation",
    max_iter: Annotated[
        int | None,
        typer.Option("--max-iter", help="Barycenter iterations per module (residual-orthogonal: rounds) at most [20]."),
    ] = None,
    tol: Annotated[
        float | None, typer.Option("--tol", help="Barycenter tolerance (relative move of the mean) [1e-7].")
    ] = None,
    device: Annotated[str, typer.Option("--device", help=checks.DEVICE_HELP)] = "auto",
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing --out (at the end).")] = False,
) -> None:
    """Align M1 M2 [M3 ...] to one anchor; write OUT/<model>/ (matched checkpoints) and a report json.

    The report is OUT/symfuse_many_report.json (anchor, per-model distances and logit differences).

    Every model gets a sub-folder named after its folder (prefixed with its position when names clash); the
    anchor model itself is written unchanged (identity transforms) so that OUT holds the whole aligned set.
    """
    models = list(models_args or [])
    if len(models) < 2:
        raise UsageError(f"M1 M2: {len(models)} model(s) given — give two or more models to align")
    if out is None:
        raise UsageError("--out: missing — give the output folder with --out DIR")
    names = output_names(models)
    index = anchor_index(anchor, models, names)
    max_iter, tol, given = _iteration_options(max_iter, tol)
    if given and index != "barycenter" and "residual-orthogonal" not in symmetries:  # accepted and ignored before
        raise UsageError(f"{' / '.join(given)}: read only with --anchor barycenter or residual-orthogonal — drop it")
    from_data = [n for n in symmetries.split(",") if n.strip() in set(kind_names()) - set(kind_names("weights"))]
    if from_data:  # registered, but found from activations only
        raise UsageError(
            f"--symmetries: {', '.join(from_data)} is not available for match-many: it is found from activations "
            "(symfuse match --data) and match-many aligns from weights — drop it, or align each model with `symfuse "
            f"match MODEL ANCHOR --symmetries {from_data[0].strip()} --data DATASET`"
        )
    sym = checks.kinds("--symmetries", symmetries, "weights")
    for m in models:
        checks.local_path("M1 M2", m)
    checks.distinct("M1 M2", models, "model", weighted=False)
    for m in models:
        checks.checkpoint(m)
    from symfuse.data.vocab import check_same_vocabulary  # loads torch: after the options are checked

    check_same_vocabulary(models, "matching pairs the models' embedding rows")
    device = checks.device("--device", device)
    if "residual-orthogonal" in sym:  # one stream map per model: the models are aligned as wholes
        _whole_models(models, out, names, index, sym, max_iter, tol, device, overwrite)
        return
    with claim_output(out, overwrite, inputs=models):
        from symfuse.match import assemble_matched, match_many

        result = match_many(models, anchor=index, symmetries=sym, max_iter=max_iter, tol=tol, device=device)
        anchor_model = None if result["anchor"] == "barycenter" else models[result["anchor"]]
        per_model = []
        with atomic_output_dir(out, overwrite=overwrite) as tmp:
            for m, name, ts in zip(models, names, result["transforms"], strict=True):
                rep = assemble_matched(m, ts, tmp / name, anchor=anchor_model, symmetries=sym, logit_check=True)
                keys = ("distance_before", "distance_after", "max_abs_logit_diff", "exact", "within_tolerance")
                per_model.append({"model": m, "out": name} | {k: rep.get(k) for k in keys})  # ot-soft: exact false
            if anchor_model is None:  # barycenter: each model's distance to the mean, before and after alignment
                _barycenter_distances(models, [tmp / n for n in names], per_model)
            report = {
                "anchor": result["anchor"] if anchor_model is None else anchor_model,
                "anchor_mode": anchor,
                "symmetries": sym,
                "device": device,
                "models": per_model,
                "max_iterations": max(result["iterations"].values(), default=0),
            }
            (tmp / REPORT).write_text(json.dumps(report, indent=2))
    typer.echo(json.dumps(report, indent=2))
    typer.echo(f"aligned checkpoints in {out}")


def _whole_models(models, out, names, index, sym, rounds, tol, device, overwrite) -> None:
    """match-many with ``residual-orthogonal``: each model onto the anchor, or all onto their mean (universe)."""
    from symfuse.match.universe import match_many_residual_orthogonal

    inner = [k for k in sym if k != "residual-orthogonal"]
    with claim_output(out, overwrite, inputs=models), atomic_output_dir(out, overwrite=overwrite) as tmp:
        result = match_many_residual_orthogonal(models, tmp, names, index, inner, rounds, tol, device)
        report = {"anchor_mode": index if isinstance(index, str) else "model", "symmetries": sym, "device": device,
                  **result}  # fmt: skip
        (tmp / REPORT).write_text(json.dumps(report, indent=2))
    typer.echo(json.dumps(report, indent=2))
    typer.echo(f"aligned checkpoints in {out}")


def _barycenter_distances(models: list[str], aligned: list[Path], per_model: list[dict]) -> None:
    """Fill ``distance_before`` / ``distance_after``: each model's distance to the K models' mean (module weights)."""
    from symfuse.checkpoint import CheckpointReader
    from symfuse.match.many import squared_distances_to_mean

    for key, folders in (("distance_before", models), ("distance_after", aligned)):
        readers = [CheckpointReader(f) for f in folders]
        try:
            for row, sq in zip(per_model, squared_distances_to_mean(readers), strict=True):
                row[key] = sq**0.5
        finally:
            for r in readers:
                r.close()
