"""``symfuse merge``: merge K checkpoints with a registered strategy."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml

from symfuse.cli import app, checks
from symfuse.cli.bars import fraction_bar
from symfuse.errors import UsageError
from symfuse.merge.registry import (  # no torch: names only
    MERGERS,
    OUT_DTYPE_NAMES,
    RETIRED_PARAMS,
    merger_params,
    param_names,
)
from symfuse.outputs import claim_output


@app.command(cls=checks.multi_value_command("--models", "--stats", "--weights", "--data"))
def merge(
    out_arg: Annotated[Path | None, typer.Argument(metavar="[OUT]", help="Output folder (or --out OUT).")] = None,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            help="Merge YAML: symfuse's (strategy, models, stats, base, weights, params) or mergekit's as it is "
            "(merge_method, models, base_model, parameters, ...); see docs/guide.md.",
        ),
    ] = None,
    strategy: Annotated[
        str | None, typer.Option("--strategy", help=f"A registered strategy: {', '.join(MERGERS.names())}.")
    ] = None,
    out: Annotated[
        Path | None, typer.Option("--out", help="Output save_pretrained folder (new unless --overwrite).")
    ] = None,
    models: Annotated[
        list[str] | None,
        typer.Option("--models", metavar="A B [C ...]", help="Checkpoints to merge (two or more; passthrough: one)."),
    ] = None,
    stats: Annotated[
        list[Path] | None,
        typer.Option("--stats", metavar="SA SB [...]", help="One statistics folder (or file) per model, in order."),
    ] = None,
    weights: Annotated[
        list[float] | None, typer.Option("--weights", metavar="wA wB [...]", help="One weight per model (>= 0).")
    ] = None,
    base: Annotated[
        str | None, typer.Option("--base", help="Base checkpoint (task vectors; optional: nuslerp, multislerp).")
    ] = None,
    param: Annotated[
        list[str] | None,
        typer.Option("--param", metavar="NAME=VALUE", help="Any parameter of the strategy (repeat for several)."),
    ] = None,
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
    device: Annotated[
        str | None, typer.Option("--device", help=checks.DEVICE_HELP + " Default: the config's device, else auto.")
    ] = None,
    refit_heads: Annotated[
        bool,
        typer.Option("--refit-heads", help="Refit each head to the merged body on its model's own --data."),
    ] = False,
    refit_ridge: Annotated[
        float | None, typer.Option("--refit-ridge", help="Head refit: pull towards the merged head (0.1).")
    ] = None,
    allow_label_mismatch: Annotated[
        bool,
        typer.Option(
            "--allow-label-mismatch", help="Accept --data sharing no class with its model's head (refit, regmean++)."
        ),
    ] = False,
    out_dtype: Annotated[
        str | None,
        typer.Option(
            "--out-dtype", help=f"Write the merged tensors in {'|'.join(OUT_DTYPE_NAMES)} (default: the first model's)."
        ),
    ] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing --out (at the end).")] = False,
    align: Annotated[
        str | None,
        typer.Option(
            "--align",
            metavar="KINDS",
            help="Align every model onto the first before merging, by these symmetry kinds (comma-separated, as "
            "symfuse match's --symmetries: residual-orthogonal, ffn-permutation, ...); any strategy.",
        ),
    ] = None,
    align_data: Annotated[
        str | None, typer.Option("--align-data", help="Dataset for --align kinds found from activations.")
    ] = None,
) -> None:
    """Merge models: --models A B [C ...] [--stats SA SB ...] [--weights wA wB ...] --out OUT.

    Or from one YAML file: `symfuse merge --config merge.yaml OUT`. The file holds everything but the output
    (and --overwrite); flags that it could hold are refused alongside --config rather than silently mixed.
    A mergekit config (merge_method: ties, models: [{model, parameters}], ...) is read as it is; what symfuse
    cannot merge yet is refused in one line naming the key.
    Writes a save_pretrained folder with symfuse_report.json (strategy, inputs, seconds).
    """
    if out is not None and out_arg is not None:
        raise UsageError(f"OUT: given twice ({out_arg} and --out {out}) — give the output folder once")
    out = out if out is not None else out_arg
    if out is None:
        raise UsageError("--out: missing — give the output folder: --out OUT (or OUT after --config FILE)")
    # the parameter flags are shortcuts for --param NAME=VALUE: the strategy's Params validates them all
    shortcuts = {"alpha": alpha, "lam": lam, "density": density, "drop": drop, "combine": combine, "seed": seed}
    shortcuts |= {"dtype": dtype, "epsilon": epsilon, "data": data or None, "max_examples": max_examples}
    refit_flags = (refit_heads, refit_ridge)
    if config is not None:
        flags = {"--strategy": strategy, "--models": models, "--stats": stats, "--weights": weights, "--base": base}
        flags |= {"--param": param} | {f"--{k}": v for k, v in shortcuts.items()}
        flags |= {"--allow-label-mismatch": allow_label_mismatch or None}
        req = _from_config(config, flags, refit_flags, device, out_dtype)
    else:
        given = {k: (v, f"--{k.replace('_', '-')}") for k, v in shortcuts.items() if v is not None}
        given |= _param_options(param or [], shortcuts)
        req = _Request(strategy, list(models or []), stats, weights, base, given, allow_label_mismatch,
                       (device or "auto", "--device"), *_refit_flags(*refit_flags), out_dtype)  # fmt: skip
    if req.out_dtype is not None:  # a merge file's is checked by its schema
        checks.one_of("--out-dtype", req.out_dtype, OUT_DTYPE_NAMES)
    strategy, models, stats, base = req.strategy, req.models, req.stats, req.base
    dev, params, refit = _resolve(req, config, device)
    from symfuse.merge import merge_checkpoints

    def run(inputs: list[str], card: dict | None = None) -> Path:
        with fraction_bar(f"merging ({strategy})") as shown:
            return merge_checkpoints(strategy, inputs, out, stats=stats, base=base, overwrite=overwrite, card=card,
                                     head_refit=refit, device=dev, out_dtype=req.out_dtype, on_progress=shown,
                                     **params)  # fmt: skip

    kinds = None
    if align is not None:
        from symfuse.cli.merge_align import ALIGN_KINDS, check_align

        kinds = checks.names_list("--align", align, ALIGN_KINDS, "symmetries")
        check_align(kinds, align_data, stats)
    elif align_data is not None:  # it was ignored: the output was the unaligned merge's
        raise UsageError("--align-data: given without --align — add --align KINDS (e.g. ffn-permutation), or drop it")
    with claim_output(out, overwrite):
        if kinds is None:
            path = run(models)
        else:
            from symfuse.cli.merge_align import merge_aligned

            path = merge_aligned(models, kinds, align_data, dev, run)
    report = json.loads((path / "symfuse_report.json").read_text())
    typer.echo(f"{path} ({strategy}, {report['seconds']} s)")


REFIT_SHARED = ("data", "max_examples")  # flags a head refit reads (and regmean++ too); the device is the merge's


@dataclass
class _Request:
    """A merge as asked for, from flags or a merge file; each value with how the user wrote it where it may fail."""

    strategy: str | None
    models: list[str]
    stats: list[Path] | None
    weights: list[float] | None
    base: str | None
    given: dict[str, tuple[Any, str]]  # the strategy's parameters: (value, flag or file key)
    allow_label_mismatch: bool
    device_given: tuple[Any, str]
    refit_on: bool
    refit_given: dict[str, tuple[Any, str]]
    out_dtype: str | None = None


def _refit_flags(refit_heads: bool, refit_ridge: float | None) -> tuple[bool, dict[str, tuple[Any, str]]]:
    if refit_ridge is not None and not refit_heads:
        raise UsageError("--refit-ridge: given without --refit-heads — add --refit-heads, or drop it")
    return refit_heads, ({"ridge": (refit_ridge, "--refit-ridge")} if refit_ridge is not None else {})


def _from_config(
    config: Path,
    flags: dict[str, Any],
    refit_flags: tuple[bool, float | None],
    device: str | None,
    out_dtype: str | None,
) -> _Request:
    """The request of a merge file; flags it could hold are refused beside it rather than silently mixed."""
    clash = [k for k, v in flags.items() if v is not None and v != []]
    if clash:
        raise UsageError(
            f"{', '.join(clash)}: given with --config — put it in {config}, or drop --config and use flags only"
        )
    from symfuse.merge_config import load_merge_file

    mf = load_merge_file(config)
    if refit_flags[0] or refit_flags[1] is not None:
        raise UsageError(f"--refit-heads / --refit-ridge: given with --config — put head_refit: in {config}")
    return _Request(
        mf.strategy, list(mf.models or []), [Path(s) for s in mf.stats] if mf.stats is not None else None,
        mf.weights, mf.base, {k: (v, mf.key_of(k)) for k, v in mf.params.items()}, mf.allow_label_mismatch,
        (device, "--device") if device is not None else (mf.device, f"{config}: device"),
        mf.head_refit is not None, {k: (v, f"head_refit.{k}") for k, v in (mf.head_refit or {}).items()},
        out_dtype or mf.out_dtype,
    )  # fmt: skip


def _resolve(req: _Request, config: Path | None, device: str | None) -> tuple[Any, dict[str, Any], dict | None]:
    """Check the request (cheap checks first): the device, the strategy's params and the head refit's options."""
    given, refit_given, device_given = req.given, req.refit_given, req.device_given
    if req.strategy is None:
        raise UsageError("--strategy: missing — give --strategy NAME, or --config merge.yaml")
    if "device" in given:  # an older spelling (regmean++'s --param device=...): the merge's device
        if device is not None and device != given["device"][0]:
            raise UsageError(f"{given['device'][1]}: given with --device — give the device once, with --device")
        device_given = given.pop("device")
    dev = checks.device(device_given[1], str(device_given[0]))
    if req.refit_on and config is None:  # --data / --max-examples: the refit's (and the merger's if it has them)
        checks.one_of("--strategy", req.strategy, MERGERS.names())
        fields = MERGERS[req.strategy].Params.model_fields
        for k in REFIT_SHARED:
            if k in given:
                refit_given[k] = given[k] if k in fields else given.pop(k)
    if req.refit_on:
        refit_given.setdefault("device", (dev, device_given[1]))
    try:
        params = _validate(req.strategy, req.models, req.stats, req.weights, req.base, given)
    except UsageError as exc:
        if config is None:
            raise
        # the shared checks name the flag; in a file it is the key of the same name
        raise UsageError(f"{config}: {exc}") from exc
    refit = _refit_options(refit_given, len(req.models), config) if req.refit_on else None
    if not req.allow_label_mismatch:  # each model's own data: a head sharing no class with it means the wrong data
        label = refit_given.get("data", given.get("data", (None, "--data")))[1]
        _check_data_labels(req.models, (refit or params).get("data") or [], label, config)
    return dev, params, refit


def _refit_options(given: dict[str, tuple[Any, str]], n_models: int, config: Path | None) -> dict[str, Any]:
    """The head refit's options (``--data`` one per model, ``--refit-ridge`` ...), checked; datasets loaded once.

    Raises:
        UsageError: missing or miscounted data, a bad value (named by its flag, or ``head_refit.<key>`` in a file).
    """
    from pydantic import ValidationError

    from symfuse.merge.head_refit import RefitOptions

    where = f"{config}: " if config is not None else ""
    data, label = given.get("data", (None, "head_refit.data" if config is not None else "--data"))
    if not data:
        raise UsageError(
            f"{where}{label}: head refit reads each model's own data — give one dataset per model, in order"
        )
    if not isinstance(data, list) or len(data) != n_models:
        n = len(data) if isinstance(data, list) else 1
        raise UsageError(f"{where}{label}: {n} dataset(s) for {n_models} models — give one per model, in order")
    if "device" in given:
        checks.device(given["device"][1], str(given["device"][0]))
    values = {k: v for k, (v, _) in given.items()}
    try:
        options = RefitOptions.model_validate(values)
    except ValidationError as exc:
        e = exc.errors()[0]
        key = str(e["loc"][0]) if e["loc"] else "head_refit"
        label = given[key][1] if key in given else f"head_refit.{key}"
        raise UsageError(f"{where}{label}: {e['msg'].removeprefix('Value error, ')}") from exc
    for d in options.data:
        checks.dataset(label, d)
    return options.model_dump()


def _check_data_labels(models: list[str], data: list[str], label: str, config: Path | None) -> None:
    """Refuse ``data`` (one per model) whose classes cannot be its model's head's (see ``data_mismatch``).

    Raises:
        UsageError: naming the dataset, its model and the fix (``--allow-label-mismatch`` or the file's key).
    """
    from symfuse.checkpoint import resolve_checkpoint
    from symfuse.config_json import check_head_labels, read_config_json
    from symfuse.data import load_task_dataset
    from symfuse.data.labels import data_mismatch, head_labels

    for model, d in zip(models, data, strict=False):
        folder = resolve_checkpoint(model)
        check_head_labels(folder, raw := read_config_json(folder))
        head = head_labels(raw)
        if not head:
            continue
        ds = load_task_dataset(d)
        problem = data_mismatch(head, ds.labels, ds.task == "regression")
        if problem:
            where, allow = (
                (f"{config}: ", f"put allow_label_mismatch: true in {config}")
                if config
                else ("", "add --allow-label-mismatch")
            )
            raise UsageError(
                f"{where}{label}: {d} (for {model}) {problem} — give each model the data its head was trained on, in "
                f"model order, or {allow}"
            )


def _param_options(values: list[str], shortcuts: dict[str, Any]) -> dict[str, tuple[Any, str]]:
    """``--param NAME=VALUE`` options as ``{name: (value, label)}`` (values read as YAML scalars: 1, 0.5, ties)."""
    out: dict[str, tuple[Any, str]] = {}
    for item in values:
        name, sep, text = item.partition("=")
        name = name.strip()
        if not sep or not name:
            raise UsageError(f"--param: {item!r} is not NAME=VALUE — give e.g. --param density=0.3")
        if name in out or shortcuts.get(name) is not None:
            raise UsageError(f"--param: {name} given twice — give each parameter once")
        try:
            value = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError as exc:
            raise UsageError(f"--param: {item!r} has an unreadable value — give a number, word or true/false") from exc
        out[name] = (value, f"--param {name}")
    return out


def _validate(
    strategy: str,
    models: list[str],
    stats: list[Path] | None,
    weights: list[float] | None,
    base: str | None,
    given: dict[str, tuple[Any, str]],
) -> dict[str, Any]:
    """Every check of the merge's inputs (cheap ones before torch is imported); return the strategy's params.

    ``given`` maps each parameter to its value and how the user wrote it (``--alpha``, ``--param k``, ``params.k``).
    """
    _check_models(models, weights, base)  # no merger class needed: a bad value fails before torch is imported
    checks.one_of("--strategy", strategy, MERGERS.names())
    merger = MERGERS[strategy]  # imports the strategy's module (torch)
    merger.check_model_count(len(models))  # most merge two or more; slerp exactly two, passthrough one
    checks.distinct("--models", models, "model")  # after the count: slerp of A B A is three models first
    params = _strategy_params(merger, strategy, given, weights)
    data, data_label = given.get("data", (None, "--data"))
    _check_fit(merger, strategy, len(models), stats, base, (data, data_label))
    if base is not None and any(checks.same_path(base, m) for m in models):  # a zero task vector: it dilutes
        raise UsageError(f"--base: {base} is among --models too — the base is not merged; drop it from --models")
    for s in stats or []:
        checks.local_path("--stats", s, folder=False)
    for m in [*models, *([base] if base is not None else [])]:
        checks.checkpoint(m)
    if stats:
        checks.stats_files(stats, merger.required_stats)
    for d in data or []:
        checks.dataset(data_label, d)
    return params


def _check_models(models: list[str], weights: list[float] | None, base: str | None) -> None:
    """The model count, the weights and the model / base paths (no file is read)."""
    if not models:
        raise UsageError("--models: 0 model(s) given — give two or more: --models A B [C ...]")
    if weights:
        if len(weights) != len(models):
            raise UsageError(f"--weights: {len(weights)} weight(s) for {len(models)} models — give one per model")
        if not all(w >= 0 and w < float("inf") for w in weights) or sum(weights) <= 0:
            raise UsageError(f"--weights: {weights} — give finite weights >= 0 with a positive sum")
    for m in models:
        checks.local_path("--models", m)
        if (Path(m) / "adapter_config.json").is_file():
            raise UsageError(
                f"--models: {m} is a PEFT adapter folder (adapter_config.json) — merge adapters with symfuse "
                "merge-lora --adapters A B ..."
            )
    if base is not None:
        checks.local_path("--base", base)


def _strategy_params(
    merger: Any, strategy: str, given: dict[str, tuple[Any, str]], weights: list[float] | None
) -> dict[str, Any]:
    """The strategy's parameters from ``given`` and ``weights``: unknown ones refused, values checked."""
    labels = {k: label for k, (_, label) in given.items()}
    values = {k: v for k, (v, _) in given.items()}
    names = param_names(merger.Params)  # as written: a field's alias (``lambda``) where it has one
    known = set(names) | merger.Params.model_fields.keys() | RETIRED_PARAMS.keys()  # a retired one: merger_params
    if "weights" in values:  # model weights, not a parameter: said to be no parameter, with nowhere to go
        raise UsageError(f"{labels['weights']}: the model weights are not a strategy parameter — give them as "
                         "--weights wA wB ... (or weights: at the top level of a merge config)")  # fmt: skip
    extra = [labels[k] for k in values if k not in known]
    if extra:
        refit = " (--data also feeds --refit-heads: add it to refit the heads)" if "--data" in extra else ""
        raise UsageError(
            f"{', '.join(extra)}: not a parameter of --strategy {strategy} — drop it, or pick a strategy that uses it "
            f"(its parameters: {', '.join(k for k in names if k != 'weights') or 'none'}){refit}"
        )
    params = values | ({"weights": weights} if weights else {})
    try:
        default = lambda k: "--weights" if k == "weights" else f"--param {k}"  # noqa: E731
        merger_params(strategy, params, label=lambda k: labels.get(k, default(k)))
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    return params


def _check_fit(
    merger: Any, strategy: str, k: int, stats: list[Path] | None, base: str | None, data: tuple[Any, str]
) -> None:
    """The statistics, datasets and base model the strategy needs for ``k`` models: given, and only those."""
    data, data_label = data
    if stats and not merger.required_stats:
        raise UsageError(f"--stats: --strategy {strategy} reads no statistics — drop --stats")
    if merger.required_stats and not stats:
        kinds = ", ".join(sorted(merger.required_stats))
        raise UsageError(f"--stats: --strategy {strategy} needs {kinds} statistics — give one folder per model")
    if stats and len(stats) != k:
        raise UsageError(f"--stats: {len(stats)} statistics for {k} models — give one per model, in order")
    if getattr(merger, "needs_data", False) and not data:
        raise UsageError(
            f"{data_label}: --strategy {strategy} collects its Grams on each model's own data — give one dataset per "
            "model: --data DA DB [...]"
        )
    if data and (not isinstance(data, list) or len(data) != k):
        n = len(data) if isinstance(data, list) else 1
        raise UsageError(f"{data_label}: {n} dataset(s) for {k} models — give one per model, in order")
    if merger.needs_base and base is None:
        raise UsageError(f"--base: --strategy {strategy} works on task vectors — give the base model with --base")
    if base is not None and not (merger.needs_base or merger.accepts_base):
        raise UsageError(f"--base: --strategy {strategy} does not use a base model — drop --base")
