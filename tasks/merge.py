"""``merge``: one task per (strategy, variant).

Variant ``plain`` merges the fine-tuned models; ``matched`` merges the anchor with the others matched onto it;
``greedy`` merges a subset of the fine-tuned models that greedy selection tries (stored under the subset's names).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from symfuse.checkpoint import resolve_checkpoint
from symfuse.config import RunConfig
from symfuse.data.probe import content_fingerprint
from symfuse.errors import StatsMismatchError
from symfuse.merge import MERGERS, REPORT, merge_checkpoints, merger_params
from symfuse.stats import files_fingerprint
from tasks.common import (
    Progress,
    content_key,
    fetch,
    fetch_file,
    layout,
    manifests,
    open_store,
    reuse,
    scratch,
    stage_meta,
    symfuse_task,
    timed,
)
from tasks.policy import maybe_inject_fault

GREEDY = "greedy"  # the variant of greedy selection's subset merges
# Where a merge runs, not what it computes: left out of the content key.
PLACEMENT = ("device",)


def run_context(config: RunConfig, models: Sequence[str]) -> dict[str, Any]:
    """What a merger may take from the run besides its ``merge_params`` (it names them in ``Merger.run_params``).

    Args:
        config: The run.
        models: The dataset names, in merge order.
    """
    return {
        "data": [config.dataset(n).data for n in models],  # each model's own dataset
        "max_examples": config.stats.max_examples,
        "batch_size": config.stats.batch_size,
        "max_length": config.finetune.max_length,
        "seed": config.finetune.seed,
        "device": config.resolved_device(),
    }


def strategy_params(config: RunConfig, strategy: str, models: Sequence[str] = ()) -> dict[str, Any]:
    """The strategy's parameters, flattened at the task boundary: the run values it asks for, then its merge_params.

    Raises:
        ValueError: the merger asks for a run value :func:`run_context` does not have.
    """
    wanted = MERGERS[strategy].run_params
    context = run_context(config, models) if wanted else {}
    unknown = [k for k in wanted if k not in context]
    if unknown:
        raise ValueError(f"merge strategy {strategy}: run_params {unknown} unknown — choose from {sorted(context)}")
    return {k: context[k] for k in wanted} | config.strategy_params(strategy)


@symfuse_task("merge", "merge-{strategy}-{variant}")
def merge(
    config: RunConfig, strategy: str, variant: str, models: Mapping[str, str], stats: Mapping[str, Sequence[str]]
) -> str:
    """Merge ``models`` (dataset -> checkpoint URI, in merge order) with ``strategy``; return the merged URI.

    Args:
        config: The run.
        strategy: A registered strategy (``symfuse.merge.registry``); its parameters are
            ``config.merge_params[strategy]`` and the run values it names in ``run_params``.
        variant: ``plain``, ``matched`` or ``greedy`` (a subset; names the artifact).
        models: Dataset name -> checkpoint URI.
        stats: Dataset name -> statistics URIs of the kinds the strategy needs (may be empty).

    Returns:
        URI of ``runs/{run}/merged/{strategy}/{variant}`` (reused: its published version) or, merged now, of its
        staged version (``.../.v/<version>``, published with the run's set by ``publish_run``); its manifest
        ``meta.heads`` maps each dataset to the sub-folder holding the merged body with that dataset's head. A greedy
        subset's merge is published at once.
    """
    store, merger = open_store(config), MERGERS[strategy]
    params = strategy_params(config, strategy, list(models))
    if variant == GREEDY:  # one of greedy selection's subsets
        key = layout.selected_key(config.run_id, strategy, list(models))
    else:
        key = layout.merged_key(config.run_id, strategy, variant)  # type: ignore[arg-type]
    stats_uris = [u for name in models for u in stats.get(name, [])] if merger.required_stats else []
    inputs = {f"model.{n}": u for n, u in models.items()} | {f"stats{i}": u for i, u in enumerate(stats_uris)}
    base = resolve_checkpoint(config.base_model) if merger.needs_base else None
    extra = {"base": files_fingerprint(base)} if base is not None else {}
    card = {"base_model": config.base_model, "symmetries": config.symmetries if variant == "matched" else [],
            "extra": {"run_id": config.run_id, "variant": variant}}  # fmt: skip
    resolved = merger_params(strategy, params).model_dump(mode="json")  # defaults included: a new default re-merges
    resolved = {k: v for k, v in resolved.items() if k not in PLACEMENT}
    what = {"strategy": strategy, "params": resolved, "order": list(models), "card": card}
    # a head refit reads the run values RegMean++ reads (each model's data, the statistics' sampling) and the ridge
    refit = (
        (run_context(config, list(models)) | {"ridge": config.head_refit.ridge})
        if config.head_refit.applies(strategy)
        else None
    )
    if refit is not None:  # (absent when off: merges stored before the option existed are reused)
        what["head_refit"] = {k: v for k, v in refit.items() if k not in PLACEMENT}
    if refit is not None or "data" in resolved:  # the data is read: its records key the merge (a brought model's
        what["records"] = [content_fingerprint(config.dataset(n).data) for n in models]  # did not change)
    ck = content_key(what, manifests(store, inputs) | extra)
    if (uri := reuse(store, key, ck, f"merged model {strategy}-{variant}")) is not None:
        return uri
    maybe_inject_fault()
    card = card | {"inputs": [store.uri(u) for u in models.values()]}  # cards name store URIs, not scratch folders
    with scratch("merge") as tmp:
        links = tmp / "in"  # name each local model folder after its dataset: the merger names heads by folder
        links.mkdir()
        for name, uri in models.items():
            (links / name).symlink_to(fetch(store, uri), target_is_directory=True)
        files = [fetch_file(store, u) for u in stats_uris]
        with timed() as t, Progress(f"merge-{strategy}-{variant}") as progress:
            maths = {k: v for k, v in params.items() if k not in PLACEMENT}  # the merge's own device: the run's
            try:
                out = merge_checkpoints(strategy, [links / n for n in models], tmp / "out", stats=files or None,
                                        base=base, card=card, head_refit=refit, device=config.resolved_device(),
                                        model_names=list(models), on_progress=progress,
                                        **maths)  # fmt: skip
            except StatsMismatchError as exc:  # the CLI's fix (--models order, `symfuse stats`) means nothing here
                raise _in_store_terms(exc, {str(links / n): store.uri(u) for n, u in models.items()}) from exc
        written = json.loads((out / REPORT).read_text())["heads"]
        folders = written.get("folders") or {}
        heads = dict(zip(models, folders.values(), strict=True)) if folders else dict.fromkeys(models, ".")
        refitted = {}
        if "refit" in written:  # each head's logit MSE to its own model, before -> after (the report sums them up)
            pairs = {rel: [h["logit_mse_before"], h["logit_mse_after"]] for rel, h in written["refit"]["heads"].items()}
            refitted = {"head_refit": pairs}
        digests = [layout.manifest_digest(store.manifest(u)) for u in models.values()]  # read by watch_checkpoints
        meta = stage_meta("merge", f"merge-{strategy}-{variant}", t.seconds, strategy=strategy, variant=variant,
                          heads=heads, model_digests=digests, **refitted)  # fmt: skip
        # merged/* is staged: the run publishes its merged set and report together once all succeeded (publish_run)
        return store.put_dir(key, out, "merge", inputs, ck, meta, move=True, stage=variant != GREEDY)


def _in_store_terms(exc: StatsMismatchError, folders: Mapping[str, str]) -> StatsMismatchError:
    """``exc`` told in the pipeline's terms: the store's URIs for the task's scratch folders, and the pipeline's fix."""
    what = str(exc).split(" — ")[0]
    for folder, uri in folders.items():
        what = what.replace(folder, uri)
    return StatsMismatchError(
        f"{what} — the store holds statistics that do not belong to the run's models: delete that statistics "
        "artifact and run again (the run collects it anew)"
    )
