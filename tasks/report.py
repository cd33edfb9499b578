"""``report``: gather evaluations, matching distances and timings from the store; write and publish the report."""

from __future__ import annotations

import base64
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from prefect.artifacts import (
    create_image_artifact,
    create_markdown_artifact,
    create_table_artifact,
)

from symfuse.config import RunConfig
from symfuse.model_card import CARD, card_for_display
from symfuse.report import build_report, metrics_table, primary_metric
from tasks.common import (
    content_key,
    fetch,
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

INLINE_MAX_BYTES = 2 * 1024**2  # larger images are linked by their store URI instead of embedded


def image_url(file: Path, store_uri: str) -> str:
    """A URL the Prefect UI can show for a report image.

    A ``data:`` URL (embedded: the UI renders it wherever the store is), or the image's store URI when the file is
    larger than :data:`INLINE_MAX_BYTES`.
    """
    data = file.read_bytes()
    if len(data) > INLINE_MAX_BYTES:
        return store_uri
    return f"data:image/png;base64,{base64.b64encode(data).decode()}"


def absolute_images(markdown: str, folder: Path, base_uri: str) -> str:
    """``markdown`` whose relative image links (``![x](metrics.png)``) point at :func:`image_url` of each file.

    Relative links resolve against nothing in the Prefect UI (broken images); absolute links and missing files are
    left as they are.
    """

    def swap(match: re.Match) -> str:
        alt, target = match.group(1), match.group(2)
        if "://" in target or target.startswith(("data:", "/")) or not (folder / target).is_file():
            return match.group(0)
        return f"![{alt}]({image_url(folder / target, f'{base_uri}/{target}')})"

    return re.sub(r"!\[([^\]]*)\]\(([^)\s]+)\)", swap, markdown)


def _artifact_key(text: str) -> str:
    """Prefect artifact keys: lowercase letters, digits and dashes."""
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")


@symfuse_task("report", "report-{config.run_id}")
def report(
    config: RunConfig,
    evaluations: Sequence[str],
    matched: Sequence[str],
    merged: Sequence[str],
    others: Sequence[str],
    transforms: Sequence[Mapping[str, str]] = (),
    selections: Sequence[str] = (),
    inspection: str | None = None,
    paths: Sequence[str | None] = (),
) -> str:
    """Build ``report/report.md``, ``metrics.csv`` and plots; publish markdown, table and image artifacts.

    Args:
        config: The run.
        evaluations: Eval artifacts (JSON records written by the ``evaluate`` task).
        matched: Matched-model artifacts (their manifests hold the distances before/after matching).
        merged: Merged-model artifacts (linked from the Prefect UI).
        others: Every other artifact of the run (models, statistics), for the timings table.
        transforms: The matching tasks' results ``{model: transform URI}``, for the timings table.
        selections: Greedy selection records (``record_selection``): chosen subset and path, one per strategy.
        inspection: The ``inspect_models`` record (its verdict opens the report), or None.
        paths: ``loss_paths`` records (None: a pair of one basin, nothing measured).

    Returns:
        The report's URI (reused: its published version) or, built now, its staged version's (published with the
        run's merged set by ``publish_run``).
    """
    store = open_store(config)
    flat = [*others, *(uri for by_model in transforms for uri in by_model.values())]
    paths = [p for p in paths if p is not None]
    every = dict.fromkeys([*evaluations, *matched, *merged, *flat, *selections, *([inspection] if inspection else []),
                           *paths])  # fmt: skip
    inputs = {f"input{i}": uri for i, uri in enumerate(every)}
    key = layout.report_key(config.run_id)
    ck = content_key({"report": 1}, manifests(store, inputs))
    if (uri := reuse(store, key, ck, "report")) is None:
        maybe_inject_fault()
        uri = _build(config, store, key, ck, inputs, evaluations, matched, selections, inspection, paths)
    return _publish(config, store, uri, merged)


def head_refit_fact(metas: Iterable[Mapping], ridge: float) -> str | None:
    """The report's line on head refit: the merged heads' logit MSE to their own models, before -> after (or None)."""
    pairs = [pair for m in metas for pair in (m.get("head_refit") or {}).values()]
    if not pairs:
        return None
    before, after = (sum(p[i] for p in pairs) / len(pairs) for i in (0, 1))
    return (f"ridge {ridge:g}; logit MSE to each dataset's own model {before:.4g} -> {after:.4g} "
            f"(mean over {len(pairs)} merged heads)")  # fmt: skip


def _build(config, store, key, ck, inputs, evaluations, matched, selections=(), inspection=None, paths=()) -> str:
    """Gather the records from the store and write the report artifact (staged); return its staged URI."""
    records = [store.get_json(uri) for uri in evaluations]
    metas = {uri: store.manifest(uri).get("meta", {}) for uri in inputs.values()}
    distances = [d for uri in matched for d in metas[uri].get("distances", [])]
    timings = [{k: m[k] for k in ("stage", "name", "seconds")} for m in metas.values() if "seconds" in m]
    timings = list({(t["stage"], t["name"]): t for t in timings}.values())  # one row per task run
    facts = {
        "run": config.run_id,
        "base model": config.base_model,
        "datasets": ", ".join(config.dataset_names),
        "symmetries": ", ".join(config.symmetries),
        "store": store.uri(layout.run_prefix(config.run_id)),
    }
    if (refit := head_refit_fact(metas.values(), config.head_refit.ridge)) is not None:
        facts["head refit"] = refit
    with scratch("report") as tmp:
        with timed() as t:
            built = build_report(records, distances, timings, tmp, title=f"symfuse run {config.run_id}", facts=facts,
                                 selections=[store.get_json(uri) for uri in selections],
                                 inspection=store.get_json(inspection) if inspection else None,
                                 paths=[store.get_json(uri) for uri in paths])  # fmt: skip
        meta = stage_meta("report", f"report-{config.run_id}", t.seconds, metric=built.metric)
        uri = store.put_dir(key, tmp, "report", inputs, ck, meta, move=True, stage=True)
    logger().info("report metrics (%s):\n%s", built.metric, built.table.round(4).to_string())
    return uri


def _publish(config: RunConfig, store, staged: str, merged: Sequence[str]) -> str:
    """Prefect artifacts for the UI: the report (markdown), the metrics (table), links to the merged models.

    ``staged``: the report's URI (staged or published); links name the URIs the run publishes.
    """
    import pandas as pd

    key = store.key(staged)
    folder = fetch(store, staged)
    markdown = absolute_images((folder / "report.md").read_text(), folder, store.uri(key))
    long = pd.read_csv(folder / "metrics.csv")
    metric = store.manifest(staged)["meta"].get("metric") or primary_metric(long)
    headline = metrics_table(long, metric).round(4).reset_index()
    run = _artifact_key(config.run_id)
    create_markdown_artifact(markdown, key=f"{run}-report", description=f"symfuse report, {store.uri(key)}")
    create_table_artifact(
        headline.astype(object).where(headline.notna(), "").to_dict(orient="records"),
        key=f"{run}-metrics",
        description=f"{metric} per strategy x {{plain, matched}} and evaluation set",
    )
    for png in sorted(folder.glob("*.png")):
        uri = f"{store.uri(key)}/{png.name}"  # keys: one per artifact kind (the metrics table keeps <run>-metrics)
        create_image_artifact(image_url(png, uri), key=f"{run}-plot-{_artifact_key(png.stem)}",
                              description=f"{png.name} of the symfuse report, {uri}")  # fmt: skip
    rows = ["| merged model | stored at (copy the URI) | model card |", "| --- | --- | --- |"]
    for uri in merged:  # as the run publishes them (a staged URI reads the version it will publish)
        name = "-".join(store.key(uri).split("/")[-2:])  # strategy-variant
        card_key = f"{run}-card-{_artifact_key(name)}"
        where = store.uri(store.key(uri))
        try:
            card = store.read_member(uri, CARD).decode()
        except FileNotFoundError:  # greedy selection kept one model: that fine-tuned model itself, no merge card
            rows.append(f"| {name} | `{where}` | none (one model, not a merge) |")
            continue
        create_markdown_artifact(f"Stored at `{where}`\n\n{card_for_display(card)}", key=card_key,
                                 description=f"model card of {name}")  # fmt: skip
        https = store.https_url(uri, CARD)
        link = f"artifact `{card_key}`" + (f" · [README.md]({https})" if https else "")
        rows.append(f"| {name} | `{where}` | {link} |")
    about = "merged models of the run: their store URIs (folders) and model cards"
    create_markdown_artifact("\n".join(rows), key=f"{run}-merged-models", description=about)
    logger().info("report: %s", store.uri(key))
    return staged
