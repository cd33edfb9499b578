"""``finetune`` (one task per dataset) and ``bring_checkpoint`` (a model the user brings instead)."""

from __future__ import annotations

from symfuse.checkpoint import resolve_checkpoint
from symfuse.config import RunConfig
from symfuse.data.holdout import HOLDOUT_FRACTION, HOLDOUT_SPLIT
from symfuse.data.probe import content_fingerprint, split_names
from symfuse.io import checkpoint_files
from symfuse.scratch import linked_dir
from symfuse.stats import files_fingerprint
from symfuse.train import FinetuneConfig
from symfuse.train import finetune as finetune_model
from symfuse.train.finetune import HEAD_SEED_OFFSET
from tasks.common import (
    Progress,
    content_key,
    fetch,
    layout,
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


def finetune_settings(config: RunConfig, dataset: str) -> FinetuneConfig:
    """The library's fine-tuning config for one dataset (nominal micro-batch; see :func:`batch_settings`)."""
    ds, ft = config.dataset(dataset), config.finetune
    different = config.head_init == "different"  # one head seed per dataset, else the seed's one head for all
    head_seed = ft.seed + HEAD_SEED_OFFSET + 1 + config.dataset_names.index(dataset) if different else None
    return FinetuneConfig(
        epochs=ft.epochs, lr=ft.lr, batch_size=ft.batch_size, grad_accum=ft.grad_accum, max_length=ft.max_length,
        warmup_ratio=ft.warmup_ratio, head_lr_scale=ft.head_lr_scale, seed=ft.seed,
        freeze_embeddings=ft.freeze_embeddings,
        max_train_examples=ds.max_train_examples, max_eval_examples=ds.max_eval_examples, progress=False,
        label_space=union_labels(config), head_seed=head_seed,
    )  # fmt: skip


def union_labels(config: RunConfig) -> list[str] | None:
    """The union of the training datasets' classes (in dataset order) with ``labels: union``; else None."""
    return training_classes(config) if config.labels == "union" else None


def finetune_keys(config: RunConfig, dataset: str) -> tuple[str, str]:
    """Store key and content key of the fine-tuned model for ``dataset`` (the same in every process and worker).

    A dataset without a validation split (or a hub dataset, not looked at here) also keys the held-out slice its
    epochs are scored on (:mod:`symfuse.data.holdout`): a fine-tune stored when such epochs were scored on the test
    split is not reused.
    """
    cfg, base = finetune_settings(config, dataset), resolve_checkpoint(config.base_model)
    data = config.dataset(dataset).data
    held_out = "validation" not in (split_names(data) or ())  # the file names only: no record is read
    what = {"finetune": cfg, "data": data, "records": content_fingerprint(data),
            **({"selection": [HOLDOUT_SPLIT, HOLDOUT_FRACTION]} if held_out else {})}  # fmt: skip
    return layout.model_key(config.run_id, dataset), content_key(what, {"base": files_fingerprint(base)})


@symfuse_task("finetune", "finetune-{dataset}", gpu=True)
def finetune(config: RunConfig, dataset: str) -> str:
    """Fine-tune the base model on ``dataset``; return the checkpoint's URI (``runs/{run}/models/{dataset}``)."""
    store, cfg = open_store(config), finetune_settings(config, dataset)
    base = resolve_checkpoint(config.base_model)
    key, ck = finetune_keys(config, dataset)
    if (uri := reuse(store, key, ck, f"fine-tuned model {dataset}")) is not None:
        return uri
    maybe_inject_fault()
    micro, accum = batch_settings(cfg.batch_size, cfg.grad_accum)  # halved / doubled after an OOM: same updates
    with scratch("finetune") as tmp:
        with timed() as t, Progress(f"finetune-{dataset}") as progress:
            out = finetune_model(base, config.dataset(dataset).data, tmp / "model",
                                 cfg.model_copy(update={"batch_size": micro, "grad_accum": accum}),
                                 device=task_device(config), on_progress=progress)  # fmt: skip
        meta = stage_meta("finetune", f"finetune-{dataset}", t.seconds, dataset=dataset, micro_batch=micro)
        return store.put_dir(key, out, "finetune", {"base": str(config.base_model)}, ck, meta, move=True)


@symfuse_task("bring_checkpoint", "bring-{dataset}")
def bring_checkpoint(config: RunConfig, dataset: str) -> str:
    """Put the checkpoint the user brings for ``dataset`` (store URI or local folder) under the run's model key."""
    store, source = open_store(config), config.dataset(dataset).checkpoint
    if source is None:
        raise ValueError(f"dataset {dataset!r} has no checkpoint to bring; fine-tune it instead")
    key, inside = layout.model_key(config.run_id, dataset), _inside(store, source)
    folder = None if inside else resolve_checkpoint(source)
    ck = content_key(
        {"bring": dataset}, {"checkpoint": store.manifest(source) if inside else files_fingerprint(folder)}
    )
    if (uri := reuse(store, key, ck, f"brought checkpoint {dataset}")) is not None:
        return uri
    maybe_inject_fault()
    with timed() as t:
        folder = fetch(store, source) if inside else folder
    meta = stage_meta("bring_checkpoint", f"bring-{dataset}", t.seconds, dataset=dataset)
    if inside:  # an artifact of the store (a drop, a fine-tune): stored as it is, its digest kept
        return store.put_dir(key, folder, "bring_checkpoint", {"checkpoint": source}, ck, meta)
    with linked_dir(folder, checkpoint_files(folder), "bring") as files:  # not a training folder's checkpoint-*/
        return store.put_dir(key, files, "bring_checkpoint", {"checkpoint": source}, ck, meta)


def _inside(store, source: str) -> bool:
    """Whether ``source`` names an artifact of ``store`` (a URI under its root, or a key with a manifest)."""
    try:
        store.key(source)
    except ValueError:
        return False
    return store.exists(source)
