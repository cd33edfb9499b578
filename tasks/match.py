"""Matching tasks: anchor choice, module list, ONE ``match_module`` per module per model, ``assemble_matched``.

``match_module`` runs once per attention / FFN module of every non-anchor model and reads only that module's tensors.
"""

from __future__ import annotations

from collections.abc import Mapping

import symfuse.match
from symfuse.checkpoint import CheckpointReader
from symfuse.config import RunConfig
from symfuse.match.many import squared_distances_to_mean
from tasks.common import (
    content_key,
    fetch,
    fetch_file,
    layout,
    logger,
    manifests,
    open_store,
    reuse,
    scratch,
    stage_meta,
    symfuse_task,
    timed,
)
from tasks.policy import maybe_inject_fault


@symfuse_task("choose_anchor", "choose-anchor")
def choose_anchor(config: RunConfig, models: Mapping[str, str]) -> str:
    """The dataset whose model the others are matched onto.

    ``config.anchor`` names a dataset, or is ``closest``: the model closest to the plain average of all models (the
    rule of ``symfuse.match.match_many``), measured module by module with ``module_distance``.

    Raises:
        ValueError: for ``barycenter``, which is no single model (the flow runs :func:`match_module_barycenter`).
    """
    if config.anchor in models:
        return config.anchor
    if config.anchor != "closest":
        raise ValueError(f"anchor {config.anchor!r} is no single model: expected 'closest' or a dataset name")
    store = open_store(config)
    readers = [CheckpointReader(fetch(store, uri)) for uri in models.values()]
    try:
        sq = dict(zip(models, squared_distances_to_mean(readers), strict=True))
    finally:
        for r in readers:
            r.close()
    best = min(sq, key=sq.__getitem__)
    logger().info("anchor: %s (squared distances to the average: %s)", best, sq)
    return best


@symfuse_task("list_modules", "modules-{model}")
def list_modules(config: RunConfig, model: str, model_uri: str) -> list[str]:
    """Keys (``L00.attn``, ``L00.ffn``, ...) of every attention and FFN module of a checkpoint."""
    with CheckpointReader(fetch(open_store(config), model_uri)) as reader:
        return [ref.key for ref in reader.modules()]


@symfuse_task("match_module", "match-{model}-{module}")
def match_module(config: RunConfig, model: str, model_uri: str, anchor_uri: str, module: str) -> dict[str, str]:
    """Match one module of ``model`` onto the anchor (reads only that module).

    Returns:
        ``{model: transform URI}``: the shape of :func:`match_module_barycenter`'s result, so that
        :func:`assemble_matched` and the report take either task's result the same way.
    """
    store = open_store(config)
    key = layout.transform_key(config.run_id, model, module)
    ck = content_key({"module": module, "symmetries": config.symmetries},
                     manifests(store, {"model": model_uri, "anchor": anchor_uri}))  # fmt: skip
    if (uri := reuse(store, key, ck, f"transform of {model} {module}")) is not None:
        return {model: uri}
    maybe_inject_fault()
    source, anchor = fetch(store, model_uri), fetch(store, anchor_uri)
    with scratch("match") as tmp:
        with timed() as t:
            transform = symfuse.match.match_module(
                source, anchor, module, config.symmetries, device=config.resolved_device()
            )
        file = symfuse.match.save_transform(transform, tmp / f"{module}.safetensors")
        meta = stage_meta("match_module", f"match-{model}-{module}", t.seconds, module=module)
        return {model: store.put_file(key, file, "match_module", {"model": model_uri, "anchor": anchor_uri}, ck, meta)}


@symfuse_task("match_module", "match-barycenter-{module}")
def match_module_barycenter(config: RunConfig, models: Mapping[str, str], module: str) -> dict[str, str]:
    """Align one module of EVERY model to their barycenter; return ``{model: transform URI}`` (reads that module)."""
    store = open_store(config)
    keys = {n: layout.transform_key(config.run_id, n, module) for n in models}
    ck = content_key({"module": module, "symmetries": config.symmetries, "anchor": "barycenter"},
                     manifests(store, models))  # fmt: skip
    if all(store.exists(k, ck) for k in keys.values()):
        uris = {n: store.uri(k) for n, k in keys.items()}
        logger().info("reused stored barycenter transforms of %s at %s (key %s)", module, list(uris.values()), ck[:16])
        return uris
    maybe_inject_fault()
    folders = [fetch(store, uri) for uri in models.values()]
    with scratch("match") as tmp:
        with timed() as t:
            transforms = symfuse.match.match_module_many(
                folders, module, config.symmetries, anchor="barycenter", device=config.resolved_device()
            )
        meta = stage_meta("match_module", f"match-barycenter-{module}", t.seconds, module=module)
        return {
            n: store.put_file(keys[n], symfuse.match.save_transform(tr, tmp / f"{n}.safetensors"), "match_module",
                              dict(models), ck, meta)
            for n, tr in zip(models, transforms, strict=True)
        }  # fmt: skip


@symfuse_task("match_model", "match-{model}")
def match_model(config: RunConfig, model: str, model_uri: str, anchor_uri: str) -> str:
    """Align the whole of ``model`` onto the anchor (``residual-orthogonal`` with the per-module kinds beside it).

    One map of the residual stream acts on every module at once, so one task aligns the model and writes the matched
    checkpoint (checked exact on the written folder); its statistics are recollected, not transformed.

    Returns:
        The matched checkpoint's URI (``matched/<model>``), its manifest's ``meta.distances`` one whole-model record.
    """
    store = open_store(config)
    key = layout.matched_key(config.run_id, model)
    inputs = {"model": model_uri, "anchor": anchor_uri}
    ck = content_key({"whole": 1, "symmetries": config.symmetries}, manifests(store, inputs))
    if (uri := reuse(store, key, ck, f"matched model {model}")) is not None:
        return uri
    maybe_inject_fault()
    from symfuse.match.residual_orthogonal import match_residual_orthogonal_checkpoints

    inner = [k for k in config.symmetries if k != "residual-orthogonal"]
    with scratch("match") as tmp:
        with timed() as t:
            report = match_residual_orthogonal_checkpoints(
                fetch(store, model_uri),
                fetch(store, anchor_uri),
                tmp / "matched",
                inner,
                device=config.resolved_device(),
            )
        whole = {"model": model, "module": "model.whole", "before": report["distance_before"],
                 "after": report["distance_after"]}  # fmt: skip
        meta = stage_meta("match_model", f"match-{model}", t.seconds, distances=[whole],
                          distance_before=report["distance_before"], distance_after=report["distance_after"],
                          max_abs_logit_diff=report["max_abs_logit_diff"])  # fmt: skip
        return store.put_dir(key, tmp / "matched", "match_model", inputs, ck, meta, move=True)


@symfuse_task("assemble_matched", "assemble-{model}")
def assemble_matched(
    config: RunConfig,
    model: str,
    model_uri: str,
    anchor_uri: str | None,
    transforms: Mapping[str, Mapping[str, str]],
) -> str:
    """Apply every module's transform to ``model``; return the matched checkpoint's URI.

    ``transforms`` maps each module to its matching task's result ``{model: transform URI}`` (one entry from
    :func:`match_module`, every model's from :func:`match_module_barycenter`); this model's entry is taken. With
    an anchor, the manifest's ``meta.distances`` holds, per module, the distance to it before and after matching
    (no anchor, as for a barycenter: no distances).
    """
    store = open_store(config)
    key = layout.matched_key(config.run_id, model)
    transforms = {m: by_model[model] for m, by_model in transforms.items()}
    inputs = {"model": model_uri} | ({"anchor": anchor_uri} if anchor_uri else {})
    inputs |= {f"transform.{m}": u for m, u in transforms.items()}
    ck = content_key({"assemble": sorted(transforms)}, manifests(store, inputs))
    if (uri := reuse(store, key, ck, f"matched model {model}")) is not None:
        return uri
    maybe_inject_fault()
    files = {module: fetch_file(store, uri) for module, uri in transforms.items()}
    with scratch("assemble") as tmp:
        with timed() as t:
            report = symfuse.match.assemble_matched(fetch(store, model_uri), files, tmp / "matched",
                                                    anchor=fetch(store, anchor_uri) if anchor_uri else None,
                                                    symmetries=config.symmetries)  # fmt: skip
        meta = stage_meta("assemble_matched", f"assemble-{model}", t.seconds, distances=distances(model, report),
                          distance_before=report.get("distance_before"), distance_after=report.get("distance_after"),
                          max_abs_logit_diff=report.get("max_abs_logit_diff"))  # fmt: skip
        return store.put_dir(key, tmp / "matched", "assemble_matched", inputs, ck, meta, move=True)


def distances(model: str, report: Mapping) -> list[dict]:
    """Per-module ``{model, module, before, after}`` records from ``assemble_matched``'s report."""
    return [
        {"model": model, "module": r["module"], "before": r["distance_before"], "after": r["distance_after"]}
        for r in report.get("per_module", [])
    ]
