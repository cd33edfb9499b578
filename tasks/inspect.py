"""``inspect_models``: before any merge, will alignment help and will the merge work? (``symfuse inspect``).

Weights only (no data): family and shapes, the distance to the anchor before and after each symmetry kind, and a
verdict. The report opens with it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from symfuse.config import RunConfig
from symfuse.inspect import inspect_models as inspect_folders
from tasks.common import (
    content_key,
    fetch,
    layout,
    logger,
    manifests,
    open_store,
    reuse,
    stage_meta,
    symfuse_task,
    timed,
)
from tasks.policy import maybe_inject_fault


@symfuse_task("inspect_models", "inspect-{anchor}")
def inspect_models(config: RunConfig, models: Mapping[str, str], anchor: str) -> str:
    """Inspect every model against ``anchor`` (a dataset name of ``models``); return the record's URI (``inspect``).

    The record is :func:`symfuse.inspect.inspect_models`'s mapping with ``anchor`` and ``models`` named by dataset.
    """
    store = open_store(config)
    key = layout.inspect_key(config.run_id)
    names = [anchor, *(n for n in models if n != anchor)]
    inputs = {n: models[n] for n in names}
    ck = content_key({"inspect": 1, "order": names}, manifests(store, inputs))
    if (uri := reuse(store, key, ck, "inspection of the models")) is not None:
        return uri
    maybe_inject_fault()
    folders = [str(fetch(store, models[n])) for n in names]
    with timed() as t:
        record = inspect_folders(folders, device=config.resolved_device())
    record = by_name(record, dict(zip(folders, names, strict=True)))
    logger().info("inspect: %s — %s", record["verdict"], record["reason"])
    meta = stage_meta("inspect_models", f"inspect-{anchor}", t.seconds, verdict=record["verdict"])
    return store.put_json(key, record, "inspect_models", inputs, ck, meta)


def by_name(record: dict, names: Mapping[str, str]) -> dict:
    """``record`` with every model folder (a cache path on this worker) written as its dataset name."""
    text = json.dumps(record)
    for folder, name in sorted(names.items(), key=lambda kv: -len(kv[0])):
        text = text.replace(json.dumps(folder)[1:-1], name)
    return json.loads(text)
