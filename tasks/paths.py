"""``loss_paths``: where alignment matters, the loss along the straight path from the anchor to a model.

Only for a model that is NOT a fine-tune of the anchor's base (the inspection's verdict for its pair is not
``same-basin``): models trained from different initialisations, brought to the run. On the model's own validation
split, the loss of ``(1-λ)·anchor + λ·model`` before and after alignment (:func:`symfuse.inspect.paths.path_figures`),
so the report shows what matching bought. For fine-tunes of one base nothing is computed (matching is a no-op there).
"""

from __future__ import annotations

from pathlib import Path

from symfuse.checkpoint import CheckpointReader
from symfuse.config import RunConfig
from symfuse.config_json import read_config_json
from symfuse.data.labels import differ_in_classes
from symfuse.data.probe import content_fingerprint
from symfuse.inspect.paths import path_figures
from symfuse.inspect.verdict import SAME_BASIN
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

SPLIT = "validation"
MAX_EXAMPLES = 64  # a loss estimate per λ, not an evaluation: a fixed, seeded subset


def shapes(folder: str) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in a checkpoint folder."""
    with CheckpointReader(folder) as r:
        return {n: tuple(r.shape(n)) for n in r.names()}


@symfuse_task("loss_paths", "paths-{name}")
def loss_paths(config: RunConfig, name: str, model: str, anchor: str, matched: str, inspection: str) -> str | None:
    """The loss path from ``anchor`` to ``model`` and to its ``matched`` copy; None when the pair is of one basin.

    Args:
        config: The run.
        name: The model's dataset name (its validation split is the probe).
        model: The model's URI.
        anchor: The anchor model's URI.
        matched: The model aligned onto the anchor (same function as ``model``).
        inspection: The ``inspect_models`` record's URI (its pair verdicts decide).

    Returns:
        The record's URI (``runs/<run>/paths/<name>``): :func:`~symfuse.inspect.paths.path_figures`'s mapping with
        ``model``, or ``skipped`` naming why no path was measured (heads of different shapes); None for a pair of one
        basin.
    """
    store = open_store(config)
    pair = next((p for p in store.get_json(inspection)["pairs"] if p["model"] == name), None)
    if pair is None or pair.get("verdict") == SAME_BASIN:
        return None
    key = layout.paths_key(config.run_id, name)
    inputs = {"anchor": anchor, "model": model, "matched": matched}
    data = config.dataset(name).data
    what = {"paths": 1, "data": data, "records": content_fingerprint(data), "split": SPLIT, "examples": MAX_EXAMPLES}
    ck = content_key(what, manifests(store, inputs))
    if (uri := reuse(store, key, ck, f"loss path to {name}")) is not None:
        return uri
    maybe_inject_fault()
    a, b, c = (str(fetch(store, u)) for u in (anchor, model, matched))
    with timed() as t:
        sa, sb = shapes(a), shapes(b)
        differ = sorted(n for n in sa.keys() | sb.keys() if sa.get(n) != sb.get(n))
        named = differ_in_classes(read_config_json(Path(a)), read_config_json(Path(b)))
        if differ:
            record = {"skipped": f"{len(differ)} tensors differ in shape from the anchor's (e.g. {differ[0]}): a "
                                 "straight path needs one architecture and one head"}  # fmt: skip
        elif named:
            record = {"skipped": f"the anchor and {name}: {named}: a straight path needs one label set, in one order"}
        else:
            record = path_figures(a, b, c, config.dataset(name).data, split=SPLIT, max_examples=MAX_EXAMPLES,
                                  device=config.resolved_device())  # fmt: skip
    record["model"] = name
    if "plain" in record:
        logger().info("loss path to %s: barrier %.4g plain, %.4g aligned", name,
                      record["plain"]["barrier"], record["aligned"]["barrier"])  # fmt: skip
    meta = stage_meta("loss_paths", f"paths-{name}", t.seconds)
    return store.put_json(key, record, "loss_paths", inputs, ck, meta)
