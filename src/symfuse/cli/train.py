"""``symfuse finetune``: fine-tune a base model on a task dataset."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from symfuse.cli import app, checks
from symfuse.cli.bars import terminal_bars
from symfuse.config import DATASET_RESOLUTION
from symfuse.errors import UsageError
from symfuse.outputs import claim_output

MAX_EPOCHS = 1000  # finetune --epochs: passes over the data (an int64-sized count ran until killed)


@app.command()
def finetune(
    base: Annotated[str, typer.Argument(help="Base checkpoint folder, 'minilm', or a hub id.")],
    data: Annotated[str, typer.Option("--data", help=DATASET_RESOLUTION)],
    out: Annotated[Path, typer.Option("--out", help="Output folder (save_pretrained layout + symfuse_train.json).")],
    epochs: Annotated[int, typer.Option("--epochs", help=f"Training epochs (1 .. {MAX_EPOCHS}).")] = 3,
    max_train_examples: Annotated[
        int | None, typer.Option("--max-train-examples", help="Training examples at most (all when absent).")
    ] = None,
    max_eval_examples: Annotated[int | None, typer.Option("--max-eval-examples", help="Subsample validation.")] = None,
    lr: Annotated[float, typer.Option("--lr", help="Learning rate (0 < lr <= 1).")] = 1e-5,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Examples per batch.")] = 16,
    grad_accum: Annotated[int, typer.Option("--grad-accum", help="Gradient accumulation steps.")] = 1,
    max_length: Annotated[int, typer.Option("--max-length", help="Tokens per example at most.")] = 128,
    seed: Annotated[int, typer.Option("--seed", help="Random seed.")] = 13,
    device: Annotated[str, typer.Option("--device", help=checks.DEVICE_HELP)] = "auto",
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing --out (at the end).")] = False,
    labels: Annotated[
        str,
        typer.Option(
            "--labels",
            help="Label space: 'per-dataset' (a head over --data's classes) or 'union' (one binary output per class "
            "of the union of the --union-of datasets' classes, trained on --data's own; merge then merges each class "
            "only over the models that learned it).",
        ),
    ] = "per-dataset",
    union_of: Annotated[
        str | None,
        typer.Option("--union-of", help="With --labels union: the training datasets, comma-separated, in order."),
    ] = None,
    head_seed: Annotated[
        int | None,
        typer.Option("--head-seed", help="Seed of the new head's initialisation (default: derived from --seed)."),
    ] = None,
    head_lr_scale: Annotated[
        float,
        typer.Option("--head-lr-scale", help="Learning rate of the new task head = --lr x this (0 < x <= 1000)."),
    ] = 1.0,
    freeze_embeddings: Annotated[
        bool,
        typer.Option(
            "--freeze-embeddings",
            help="Keep the token embedding table as in BASE (no gradient or optimizer state for it: faster).",
        ),
    ] = False,
) -> None:
    """Fine-tune BASE on a dataset and write the fine-tuned checkpoint."""
    checks.at_least("--epochs", epochs, 1)
    checks.at_most("--epochs", epochs, MAX_EPOCHS, "3")  # 10^20 trained until killed
    checks.seed("--seed", seed)
    checks.seed("--head-seed", head_seed)
    checks.at_least("--max-train-examples", max_train_examples, 1)
    checks.at_least("--max-eval-examples", max_eval_examples, 1)
    checks.positive("--lr", lr, "a learning rate")
    checks.at_most("--lr", lr, 1, "2e-5")  # AdamW steps of lr x ~1 per weight: above 1, every weight is noise
    checks.positive("--head-lr-scale", head_lr_scale, "a learning-rate multiplier")
    checks.at_most("--head-lr-scale", head_lr_scale, 1000, "10")
    checks.at_least("--batch-size", batch_size, 1)
    checks.at_least("--grad-accum", grad_accum, 1)
    checks.at_least("--max-length", max_length, 8)
    device = checks.device("--device", device)
    checks.one_of("--labels", labels, ("per-dataset", "union"))
    if (labels == "union") != (union_of is not None):
        raise UsageError(
            "--union-of: give it exactly with --labels union — the comma-separated training datasets whose classes "
            "form the union (e.g. --labels union --union-of crowdflower,goemotions,meld)"
        )
    checks.local_path("BASE", base)
    checks.checkpoint(base, arch=False)
    from symfuse.train import TRAIN_REPORT, FinetuneConfig
    from symfuse.train import finetune as run

    space = None
    if union_of is not None:
        from symfuse.data import load_task_dataset
        from symfuse.data.labels import union_label_names

        names = checks.names_list("--union-of", union_of, [s.strip() for s in union_of.split(",")], "datasets")
        for name in names:
            checks.dataset("--union-of", name)
            if (task := load_task_dataset(name).task) not in ("classification", "pair_classification"):
                raise UsageError(f"--union-of: {name} is a {task} dataset — union labels are the classes of "
                                 "classification datasets; drop it")  # fmt: skip
        space = union_label_names(load_task_dataset(n).labels for n in names)
    cfg = FinetuneConfig(
        epochs=epochs,
        lr=lr,
        batch_size=batch_size,
        grad_accum=grad_accum,
        max_length=max_length,
        max_train_examples=max_train_examples,
        max_eval_examples=max_eval_examples,
        seed=seed,
        label_space=space,
        head_seed=head_seed,
        head_lr_scale=head_lr_scale,
        freeze_embeddings=freeze_embeddings,
    )
    with terminal_bars(), claim_output(out, overwrite):
        checks.dataset("--data", data)
        folder = run(base, data, out, cfg, device=device, overwrite=overwrite)
    report = json.loads((folder / TRAIN_REPORT).read_text())
    for e in report["epochs"]:
        line = f"epoch {e['epoch']}: train loss {e['train_loss']:.4f}"
        if e.get("split"):  # scored on validation, else on a slice held out of train (never on test)
            scored = "val" if e["split"] == "validation" else "held-out"
            line += f"  {scored} loss {e['val_loss']:.4f}  {e['primary']} {e[e['primary']]:.4f}"
        typer.echo(line + ("  (best)" if e.get("best") else ""))
    typer.echo(f"wrote {folder} ({report['seconds']:.1f}s)")
