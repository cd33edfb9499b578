"""``collect_stats``: statistics of one model on its dataset, one task per (model, kind)."""

from __future__ import annotations

import symfuse.stats
from symfuse.config import RunConfig
from symfuse.data.probe import content_fingerprint
from symfuse.match import TRANSFORMS_FILE
from tasks.common import (
    ArtifactStore,
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
    task_device,
    timed,
)
from tasks.policy import batch_settings, maybe_inject_fault


def stats_settings(config: RunConfig, dataset: str, kind: str) -> dict:
    """What changes a statistics file besides the model: kind, data, caps, sequence length, Gram dtype."""
    settings = {
        "kind": kind,
        "data": config.dataset(dataset).data,
        "records": content_fingerprint(config.dataset(dataset).data),  # the name alone kept stats of old records
        "max_examples": config.stats.max_examples,
        "batch_size": config.stats.batch_size,  # nominal; an OOM retry splits it without changing the sums
        "max_length": config.finetune.max_length,
        "seed": config.finetune.seed,
    }
    if kind == "gram" and config.stats.gram_dtype != "float64":  # float64 Grams keep the keys they always had
        settings["gram_dtype"] = config.stats.gram_dtype
    return settings


def stats_keys(
    store: ArtifactStore, config: RunConfig, model: str, model_uri: str, kind: str, dataset: str | None = None
) -> tuple[str, str]:
    """Store key and content key of ``kind`` statistics of a model (the same in every process and worker)."""
    dataset = dataset or model
    ck = content_key(stats_settings(config, dataset, kind), manifests(store, {"model": model_uri}))
    return layout.stats_key(config.run_id, model, dataset, kind), ck


@symfuse_task("collect_stats", "stats-{model}-{kind}", gpu=True)
def collect_stats(config: RunConfig, model: str, model_uri: str, kind: str, dataset: str | None = None) -> str:
    """Collect ``kind`` statistics (gram | fisher) of a model on its training data; return the stats URI.

    Args:
        config: The run.
        model: The model's name in keys (a dataset name, or ``<dataset>.matched`` for a matched model).
        model_uri: The checkpoint artifact.
        kind: ``gram`` or ``fisher``.
        dataset: Dataset the statistics come from (default: ``model``).
    """
    store, dataset = open_store(config), dataset or model
    key, ck = stats_keys(store, config, model, model_uri, kind, dataset)
    if (uri := reuse(store, key, ck, f"{kind} statistics of {model}")) is not None:
        return uri
    maybe_inject_fault()
    micro, _ = batch_settings(config.stats.batch_size)
    with scratch("stats") as tmp:
        with timed() as t, Progress(f"stats-{model}-{kind}") as progress:
            files = symfuse.stats.collect_stats(
                fetch(store, model_uri), config.dataset(dataset).data, [kind], tmp,
                max_examples=config.stats.max_examples, batch_size=micro, device=task_device(config),
                max_length=config.finetune.max_length, seed=config.finetune.seed, progress=False,
                on_progress=progress, gram_dtype=config.stats.gram_dtype,
            )  # fmt: skip
        meta = stage_meta("collect_stats", f"stats-{model}-{kind}", t.seconds, kind=kind, dataset=dataset)
        return store.put_file(key, files[kind], "collect_stats", {"model": model_uri}, ck, meta, move=True)


@symfuse_task("follow_stats", "follow-stats-{model}-{kind}", gpu=True)
def follow_stats(config: RunConfig, model: str, matched_uri: str, stats_uri: str, kind: str) -> str:
    """Statistics of a matched model; return the URI of ``stats/<model>.matched/<model>/<kind>``.

    The source's statistics are transformed exactly where the library can (Gram); otherwise (diagonal Fisher under a
    rotation) they are recollected on the matched model.
    """
    store, name = open_store(config), f"{model}.matched"
    key = layout.stats_key(config.run_id, name, model, kind)
    inputs = {"matched": matched_uri, "stats": stats_uri}
    ck = content_key(stats_settings(config, model, kind) | {"follow": 1}, manifests(store, inputs))
    if (uri := reuse(store, key, ck, f"{kind} statistics of matched {model}")) is not None:
        return uri
    maybe_inject_fault()
    matched = fetch(store, matched_uri)
    device = task_device(config)  # the transform (host memory) or the recollection: heavy work, under the slot
    with scratch("follow") as tmp:
        with timed() as t:
            out = symfuse.stats.transform_stats(fetch_file(store, stats_uri), matched / TRANSFORMS_FILE, matched,
                                                tmp / f"{kind}.safetensors")  # fmt: skip
        how = "transformed" if out is not None else "recollected"
        if out is None:  # the library says this kind cannot follow the transform exactly
            micro, _ = batch_settings(config.stats.batch_size)
            with timed() as t, Progress(f"follow-stats-{model}-{kind}", stage="follow-stats") as progress:
                out = symfuse.stats.collect_stats(
                    matched, config.dataset(model).data, [kind], tmp,
                    max_examples=config.stats.max_examples, batch_size=micro, device=device,
                    max_length=config.finetune.max_length, seed=config.finetune.seed, progress=False,
                    on_progress=progress, gram_dtype=config.stats.gram_dtype,
                )[kind]  # fmt: skip
        meta = stage_meta("follow_stats", f"follow-stats-{model}-{kind}", t.seconds, kind=kind, how=how)
        return store.put_file(key, out, "follow_stats", inputs, ck, meta, move=True)
