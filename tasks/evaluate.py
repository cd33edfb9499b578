"""``evaluate``: one model (fine-tuned or merged) on one evaluation set; the metrics JSON goes to the store."""

from __future__ import annotations

import json
from pathlib import Path

from symfuse.config import RunConfig
from symfuse.data import load_task_dataset
from symfuse.data.labels import shared_label_names
from symfuse.data.probe import content_fingerprint
from symfuse.evaluate import evaluate_model
from symfuse.evaluate.ensemble import evaluate_heads
from symfuse.evaluate.reliable import most_reliable, rate_heads
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
    task_device,
    timed,
    training_classes,
)
from tasks.policy import batch_settings, maybe_inject_fault


def describe(config: RunConfig, model: str) -> tuple[str, str]:
    """``(strategy, variant)`` of a model name: ``("individual", dataset)`` or e.g. ``("simple", "plain")``."""
    if model in config.dataset_names:
        return "individual", model
    strategy, _, variant = model.rpartition("-")
    return strategy, variant


def pick_heads(
    folder: Path, heads: dict[str, str] | None, dataset: str, data: str, ood_heads: str = "closest"
) -> list[tuple[Path, str]]:
    """The sub-folders of a merged model holding the head(s) to evaluate ``dataset`` with, and their datasets.

    A merged model of datasets with different label sets keeps one head per dataset (``heads`` from the merge
    manifest). In-domain sets use their own head. Other sets: ``vote``: every head sharing a class name with them
    (they vote, :mod:`symfuse.evaluate.ensemble`); ``reliable``: the same candidates, of which the caller keeps the
    best-rated (:mod:`symfuse.evaluate.reliable`); ``closest``: the head sharing the most class names.
    """
    if not heads:
        return [(folder, "")]
    if dataset in heads:
        return [(folder / heads[dataset], dataset)]
    labels = load_task_dataset(data).labels

    def overlap(name: str) -> int:
        id2label = json.loads((folder / heads[name] / "config.json").read_text()).get("id2label") or {}
        return len(shared_label_names(labels, id2label.values()))

    shared = {n: overlap(n) for n in heads}  # each head's config read once
    voters = {}  # one voter per head folder (a union merge's datasets all name its one head)
    for n in heads:
        if shared[n]:
            voters.setdefault(heads[n], n)
    if ood_heads in ("vote", "reliable") and len(voters) > 1:
        return [(folder / sub, n) for sub, n in voters.items()]
    best = max(heads, key=shared.__getitem__)  # ties: the first in merge order
    return [(folder / heads[best], best)]


def ood_classes(config: RunConfig, data: str) -> list[str] | None:
    """The classes an out-of-domain set ``data`` is scored over, for every model of a run alike.

    Those it shares with the union of the training datasets' classes (the RegMean paper's protocol; emotion: the six
    Ekman classes), so a model whose head lacks some of them is not scored on an easier task. None where they share
    none of those (then each head is scored over the classes it shares with the set).
    """
    return shared_label_names(load_task_dataset(data).labels, training_classes(config)) or None


@symfuse_task("evaluate", "eval-{model}-{dataset}", gpu=True)
def evaluate(config: RunConfig, model: str, model_uri: str, dataset: str) -> str:
    """Evaluate ``model`` on ``dataset``'s test split; return the URI of its metrics record (``eval/...``)."""
    store = open_store(config)
    key = layout.eval_key(config.run_id, model, dataset)
    in_domain = dataset in config.dataset_names
    data = config.dataset(dataset).data if in_domain else dataset
    cap = (config.dataset(dataset).max_eval_examples if in_domain else None) or config.evaluation.max_examples
    # scoring 3: OOD sets never in-domain, one class per example there
    settings = {"data": data, "records": content_fingerprint(data), "split": config.evaluation.split, "max": cap,
                "scoring": 3, "max_length": config.finetune.max_length, "seed": config.finetune.seed}  # fmt: skip
    scored = None if in_domain else ood_classes(config, data)
    if not in_domain:
        settings |= {"ood_heads": config.evaluation.ood_heads, "scored": scored}
    ck = content_key(settings, manifests(store, {"model": model_uri}))
    if (uri := reuse(store, key, ck, f"evaluation of {model} on {dataset}")) is not None:
        return uri
    maybe_inject_fault()
    folder = fetch(store, model_uri)
    heads = store.manifest(model_uri).get("meta", {}).get("heads")
    chosen = pick_heads(folder, heads, dataset, data, config.evaluation.ood_heads)
    micro, _ = batch_settings(64)
    common = dict(split=config.evaluation.split, max_examples=cap, device=task_device(config),
                  batch_size=micro, max_length=config.finetune.max_length, seed=config.finetune.seed)  # fmt: skip
    rating: dict[str, float] = {}
    # out_file: never write into the (possibly local) store's folder
    with scratch("eval") as tmp, timed() as t, Progress(f"eval-{model}-{dataset}") as progress:
        if len(chosen) > 1 and config.evaluation.ood_heads == "reliable":
            # rated on each head's own validation split, never on the split the model is scored on
            rating = rate_heads({n: d for d, n in chosen}, {n: config.dataset(n).data for _, n in chosen},
                                load_task_dataset(data).labels, **(common | {"split": "validation"}),
                                scored=scored, on_progress=lambda f: progress(f / 2))  # fmt: skip
            best = most_reliable(rating)
            chosen = [(d, n) for d, n in chosen if n == best]
        rest = (lambda f: progress(0.5 + f / 2)) if rating else progress  # the rating was the first half
        if len(chosen) > 1:
            metrics = evaluate_heads([d for d, _ in chosen], data, out_file=tmp / "metrics.json", scored=scored,
                                     on_progress=rest, **common)  # fmt: skip
        else:
            # a model never trained on ``dataset`` scores it out of domain even if the label sets are equal
            own = dataset == model if model in config.dataset_names else in_domain
            metrics = evaluate_model(chosen[0][0], data, out_file=tmp / "metrics.json", on_progress=rest,
                                     in_domain=None if own else False, scored=scored, **common)  # fmt: skip
    head = "+".join(h for _, h in chosen)
    metrics.pop("metrics_file", None)
    strategy, variant = describe(config, model)
    record = {"model": model, "strategy": strategy, "variant": variant, "dataset": dataset, "head": head,
              "domain": "in" if in_domain else "out", "metrics": metrics}  # fmt: skip
    if rating:
        record["head_rating"] = {"split": "validation", "scores": rating}
    meta = stage_meta("evaluate", f"eval-{model}-{dataset}", t.seconds, model=model, dataset=dataset)
    return store.put_json(key, record, "evaluate", {"model": model_uri}, ck, meta)
