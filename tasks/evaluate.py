"""``evaluate``: one model (fine-tuned or merged) on one evaluation set; the metrics JSON goes to the store."""

from __future__ import annotations

import json
from pathlib import Path

from symfuse.config import RunConfig
from symfuse.data import load_task_dataset
from symfuse.data.labels import shared_label_names
from symfuse.evaluate import evaluate_model
from tasks.common import (
    Progress,
    content_key,
    fetch,
    layout,
    manifests,
    open_store,
    reuse,
    scratch,
    stage_meta,
    symfuse_task,
    timed,
)
from tasks.policy import batch_settings, maybe_inject_fault


def describe(config: RunConfig, model: str) -> tuple[str, str]:
    """``(strategy, variant)`` of a model name: ``("individual", dataset)`` or e.g. ``("simple", "plain")``."""
    if model in config.dataset_names:
        return "individual", model
    strategy, _, variant = model.rpartition("-")
    return strategy, variant


def pick_head(folder: Path, heads: dict[str, str] | None, dataset: str, data: str) -> tuple[Path, str]:
    """The sub-folder of a merged model holding the head to evaluate ``dataset`` with, and that head's dataset.

    A merged model of datasets with different label sets keeps one head per dataset (``heads`` from the merge
    manifest). In-domain sets use their own head; other sets the head sharing the most class names with them.
    """
    if not heads:
        return folder, ""
    if dataset in heads:
        return folder / heads[dataset], dataset
    labels = load_task_dataset(data).labels

    def overlap(name: str) -> int:
        id2label = json.loads((folder / heads[name] / "config.json").read_text()).get("id2label") or {}
        return len(shared_label_names(labels, id2label.values()))

    best = max(heads, key=overlap)  # ties: the first in merge order
    return folder / heads[best], best


@symfuse_task("evaluate", "eval-{model}-{dataset}", gpu=True)
def evaluate(config: RunConfig, model: str, model_uri: str, dataset: str) -> str:
    """Evaluate ``model`` on ``dataset``'s test split; return the URI of its metrics record (``eval/...``)."""
    store = open_store(config)
    key = layout.eval_key(config.run_id, model, dataset)
    in_domain = dataset in config.dataset_names
    data = config.dataset(dataset).data if in_domain else dataset
    cap = (config.dataset(dataset).max_eval_examples if in_domain else None) or config.evaluation.max_examples
    settings = {"data": data, "split": config.evaluation.split, "max": cap}
    ck = content_key(settings, manifests(store, {"model": model_uri}))
    if (uri := reuse(store, key, ck, f"evaluation of {model} on {dataset}")) is not None:
        return uri
    maybe_inject_fault()
    folder = fetch(store, model_uri)
    head_dir, head = pick_head(folder, store.manifest(model_uri).get("meta", {}).get("heads"), dataset, data)
    micro, _ = batch_settings(64)
    # out_file: never write into the (possibly local) store's folder
    with scratch("eval") as tmp, timed() as t, Progress(f"eval-{model}-{dataset}") as progress:
        metrics = evaluate_model(head_dir, data, split=config.evaluation.split, max_examples=cap,
                                 device=config.resolved_device(), batch_size=micro,
                                 max_length=config.finetune.max_length, seed=config.finetune.seed,
                                 out_file=tmp / "metrics.json", on_progress=progress)  # fmt: skip
    metrics.pop("metrics_file", None)
    strategy, variant = describe(config, model)
    record = {"model": model, "strategy": strategy, "variant": variant, "dataset": dataset, "head": head,
              "domain": "in" if in_domain else "out", "metrics": metrics}  # fmt: skip
    meta = stage_meta("evaluate", f"eval-{model}-{dataset}", t.seconds, model=model, dataset=dataset)
    return store.put_json(key, record, "evaluate", {"model": model_uri}, ck, meta)
