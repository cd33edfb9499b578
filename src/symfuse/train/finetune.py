"""Fine-tune a base encoder on one task dataset: plain torch loop over a ``transformers`` task head.

AdamW, linear warm-up (``warmup_ratio`` of the optimizer steps) then linear decay to 0, evaluation on the
validation split after each epoch (none: on a seeded 10 % held out of train, never on test; see
:mod:`symfuse.data.holdout`), the best epoch (by the dataset's primary metric, ties by validation loss) kept.
Seeded and deterministic on CPU; mixed precision on CUDA when ``amp`` (bf16 autocast, or fp16 with loss scaling on
GPUs without bf16).

Gradient accumulation: the optimizer step sees ``batch_size * grad_accum`` examples, drawn in the same seeded order
whatever the split into micro-batches, and each micro-batch's SUMMED loss is divided by the term count of the whole
step — so ``batch_size=8, grad_accum=2`` gives the same updates as ``batch_size=16`` (bitwise up to float
summation order when dropout is off; with dropout on, equal in distribution only, because the dropout masks are drawn
per micro-batch).

Batch order (``length_buckets``): each epoch's seeded shuffle is cut into chunks of ``length_buckets`` optimizer
steps; each chunk is sorted by token count (stable) and cut into steps, and the steps of the whole epoch are
shuffled again with the same seeded generator. Every step then holds examples of similar length, so dynamic padding
wastes little compute, while the order stays a pure function of ``seed`` and the epoch. The grouping is by optimizer
step (``batch_size * grad_accum`` examples), so the accumulation identity above still holds. ``None`` keeps the
plain shuffled order. Frozen parameters (``requires_grad=False``) get no optimizer state, clipping or gradient. The
AdamW is fused (``fused_optimizer``: one kernel over every parameter, on CPU too, where PyTorch's default loops over
tensors); on CUDA batches are copied from pinned memory without blocking.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from symfuse.checkpoint import load_hf_model, validate_checkpoint
from symfuse.data import TaskDataset, collate, iter_batches, load_task_dataset, load_tokenizer
from symfuse.data.batches import epoch_steps, name_padding, readable_length
from symfuse.data.files import DatasetError
from symfuse.data.holdout import epoch_selection, selection_features
from symfuse.data.labels import LABEL_SPACE_KEY, columns_of, learned_space, too_few_classes, union_columns
from symfuse.device import resolve_device
from symfuse.errors import NonFiniteError
from symfuse.evaluate.predict import forward_logits, run_model, task_loss
from symfuse.evaluate.scoring import score_logits
from symfuse.fields import no_bool_for_numbers
from symfuse.io import check_finite_tensor
from symfuse.outputs import atomic_output_dir, check_output
from symfuse.seeds import Seed

log = logging.getLogger(__name__)

TRAIN_REPORT = "symfuse_train.json"
LOG_LINES_PER_EPOCH = 10  # INFO lines with the running loss per epoch (besides the epoch's summary line)


class FinetuneConfig(BaseModel):
    """Fine-tuning settings (paper defaults: batch 16, lr 1e-5, 6 % warm-up)."""

    model_config = ConfigDict(extra="forbid")
    _no_bool = field_validator("*", mode="before")(no_bool_for_numbers)

    epochs: int = Field(3, ge=1)
    lr: float = Field(1e-5, gt=0, le=1, description="AdamW learning rate; above 1 every step replaces the weights")
    batch_size: int = Field(16, ge=1, description="micro-batch; an optimizer step sees batch_size * grad_accum")
    grad_accum: int = Field(1, ge=1)
    max_length: int = Field(128, ge=8)
    max_train_examples: int | None = Field(None, ge=1, description="seeded train subset; held-out slices come from it")
    max_eval_examples: int | None = Field(None, ge=1, description="subsample validation (per-epoch evaluation)")
    seed: Seed = 13
    warmup_ratio: float = Field(0.06, ge=0, le=1)
    weight_decay: float = Field(0.01, ge=0)
    max_grad_norm: float | None = Field(1.0, gt=0)
    dropout: float | None = Field(None, ge=0, le=1, description="override hidden/attention dropout; None keeps it")
    amp: bool = True
    length_buckets: int | None = Field(
        50, ge=1, description="sort by length within shuffled chunks of this many optimizer steps; None: plain order"
    )
    fused_optimizer: bool = Field(
        True,
        description="AdamW's fused kernel (one pass over all parameters; CPU and CUDA, ~7x faster steps on CPU "
        "for MiniLM); False: PyTorch's default per-tensor loop",
    )
    eval_batch_size: int = Field(64, ge=1)
    label_space: list[str] | None = Field(
        None,
        description="union labels: one binary output per class of this list (the union of every training set's "
        "classes), loss only on the dataset's own; None: a head over the dataset's classes",
    )
    head_seed: Seed | None = Field(None, description="seed of the new head's generator; None: seed + HEAD_SEED_OFFSET")
    head_lr_scale: float = Field(
        1.0,
        gt=0,
        le=1000,
        description="learning rate of the task head (parameters outside the base model) = lr x this; the head starts "
        "from random weights and learns faster with a larger rate on small data",
    )
    freeze_embeddings: bool = Field(
        False,
        description="keep the input (token) embedding table at the base model's values: no gradient and no AdamW "
        "state for its vocab x d_model weights (half of MiniLM's parameters; ~17 % of a CPU fine-tune's time), and "
        "the fine-tunes of one base share it exactly (nothing to merge there)",
    )
    keep_best: bool = True
    progress: bool = True


# Dropout draws from torch's ONE process-wide generator (CPU, or the device's): ``nn.Dropout`` /
# ``F.dropout`` take no generator argument, and ``torch.random.fork_rng`` only saves and restores that one global
# state, so it cannot give threads streams of their own. Fine-tunes running in threads of one process (Prefect's
# thread task runner) would interleave their dropout draws and stop being reproducible from their seeds, so a process
# runs one fine-tune at a time. The new head is initialised from a generator of its own (:func:`_init_head`), but
# transformers first initialises it from the global generator when it builds the model, which would also shift a
# concurrent fine-tune's dropout stream: building stays under the lock too. Separate processes (the pipeline's
# ``fan_out: deployments``, one flow run per fine-tune) are isolated by construction and run in parallel.
_TRAIN_LOCK = threading.Lock()
HEAD_SEED_OFFSET = 7_919  # the head's generator: seed + this, a stream apart from the global one seeded with ``seed``


def _seed_all(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def _build_model(base: Path, data: TaskDataset, cfg: FinetuneConfig) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoModelForTokenClassification

    config = AutoConfig.from_pretrained(str(base))
    if cfg.label_space is not None:  # union labels: one binary output per class of the union
        space = learned_space(cfg.label_space, data.name, data.labels)
        config.num_labels = len(space.labels)
        config.id2label = dict(enumerate(space.labels))
        config.problem_type = "multi_label_classification"
        setattr(config, LABEL_SPACE_KEY, space.to_json())
    else:
        config.num_labels = data.num_labels
        config.id2label = data.id2label
        if data.problem_type != "token_classification":
            config.problem_type = data.problem_type
    config.label2id = {v: k for k, v in config.id2label.items()}
    if cfg.dropout is not None:
        for key in ("hidden_dropout_prob", "attention_probs_dropout_prob", "dropout", "attention_dropout"):
            if hasattr(config, key):
                setattr(config, key, cfg.dropout)
    cls = AutoModelForTokenClassification if data.is_token_task else AutoModelForSequenceClassification
    _seed_all(cfg.seed)  # whatever transformers initialises besides the head
    model, info = load_hf_model(base, cls, validate=False, config=config, ignore_mismatched_sizes=True,
                                output_loading_info=True)  # fmt: skip
    new = set(info.get("missing_keys") or ()) | {m[0] for m in info.get("mismatched_keys") or ()}
    if not new and cfg.head_seed is not None:  # the base's head fits the data: kept, so the seed draws nothing
        log.warning("--head-seed %s: %s already has a head over the data's classes, which is kept", cfg.head_seed, base)
    model = _init_head(model, new, cfg.seed + HEAD_SEED_OFFSET if cfg.head_seed is None else cfg.head_seed)
    if cfg.freeze_embeddings:
        model.get_input_embeddings().weight.requires_grad_(False)  # no gradient, no optimizer state (_param_groups)
    return model


def _init_head(model: torch.nn.Module, new: set[str], seed: int) -> torch.nn.Module:
    """Initialise the new (not loaded) Linear / LayerNorm weights from ``torch.Generator`` seeded ``seed``.

    Linear weights ~ N(0, ``config.initializer_range``) and zero biases, LayerNorm ones / zeros (transformers'
    scheme), drawn in module order: the head depends on the seed alone, whatever the global generator's state.
    """
    gen = torch.Generator().manual_seed(seed)
    std = float(getattr(model.config, "initializer_range", 0.02))
    with torch.no_grad():
        for name, module in model.named_modules():
            prefix = f"{name}." if name else ""
            if not any(f"{prefix}{p}" in new for p, _ in module.named_parameters(recurse=False)):
                continue
            if isinstance(module, torch.nn.Linear):
                w = torch.empty(module.weight.shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
                module.weight.copy_(w)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, torch.nn.LayerNorm) and module.weight is not None:
                module.weight.fill_(1.0)
                if module.bias is not None:
                    module.bias.zero_()
            else:
                log.warning("new %s weights of type %s keep transformers' initialisation", name, type(module).__name__)
    return model


def _param_groups(model: torch.nn.Module, cfg: FinetuneConfig) -> list[dict[str, Any]]:
    """AdamW groups: weight decay on matrices only; the head (outside the base model) at ``lr * head_lr_scale``.

    Frozen parameters (``requires_grad=False``) are left out: no optimizer state, no work.
    """
    prefix = f"{getattr(model, 'base_model_prefix', '')}."
    groups: dict[tuple[bool, bool], list[torch.nn.Parameter]] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            head = prefix != "." and not name.startswith(prefix)
            decay = p.ndim >= 2 and "LayerNorm" not in name
            groups.setdefault((head, decay), []).append(p)
    return [
        {"params": params, "weight_decay": cfg.weight_decay if decay else 0.0,
         "lr": cfg.lr * (cfg.head_lr_scale if head else 1.0)}
        for (head, decay), params in sorted(groups.items(), key=lambda item: (item[0][0], not item[0][1]))
    ]  # fmt: skip


def _lr_lambda(total: int, warmup: int):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total - step) / max(1, total - warmup))

    return f


@dataclass
class _Run:
    """One training run's fixed parts: the model on its device, the optimiser, and what every step needs."""

    model: torch.nn.Module
    data: TaskDataset
    cfg: FinetuneConfig
    dev: torch.device
    amp: bool
    amp_dtype: torch.dtype
    opt: torch.optim.Optimizer
    cols: list[int] | None  # union head: the dataset's own outputs
    problem: str
    pad: int
    where: str
    steps_per_epoch: int
    on_progress: Callable[[float], None] | None
    scaler: torch.amp.GradScaler = field(init=False)
    sched: torch.optim.lr_scheduler.LambdaLR = field(init=False)

    def __post_init__(self) -> None:
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.amp and self.amp_dtype == torch.float16)
        warmup = math.ceil(self.cfg.warmup_ratio * self.total)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, _lr_lambda(self.total, warmup))

    @property
    def total(self) -> int:
        """Optimizer steps in all."""
        return self.steps_per_epoch * self.cfg.epochs


def _step(run: _Run, chunk: list[dict[str, Any]], epoch: int, step: int) -> tuple[list[float], int]:
    """One optimizer step on ``chunk`` (micro-batches of ``batch_size``): each one's summed loss, the term count."""
    cfg, dev = run.cfg, run.dev
    micro = [collate(chunk[i : i + cfg.batch_size], run.pad) for i in range(0, len(chunk), cfg.batch_size)]
    if dev.type == "cuda":  # pinned host memory: the copies overlap the previous micro-batch's compute
        micro = [{k: v.pin_memory().to(dev, non_blocking=True) for k, v in b.items()} for b in micro]
    cols = run.cols
    counts = [_count(b["labels"], run.problem) if cols is None else len(b["labels"]) * len(cols) for b in micro]
    denom = max(sum(counts), 1)
    run.opt.zero_grad(set_to_none=True)
    losses = []
    for batch in micro:
        with torch.autocast(dev.type, dtype=run.amp_dtype, enabled=run.amp):
            logits = forward_logits(run.model, batch, dev)
        logits, gold = own_outputs(logits, batch["labels"].to(dev), cols, run.data.multi_label)
        loss_sum, _ = task_loss(logits, gold, run.problem)
        if not torch.isfinite(loss_sum.detach()).all():
            raise NonFiniteError(
                f"{run.where}: training loss on {run.data.name} became {float(loss_sum.detach())} at epoch {epoch}, "
                f"step {step + 1} — nothing was written; lower the learning rate (now {cfg.lr:g}) or check the "
                "data and the base weights"
            )
        run.scaler.scale(loss_sum / denom).backward()
        losses.append(float(loss_sum.detach()))
    run.scaler.unscale_(run.opt)
    if cfg.max_grad_norm:
        torch.nn.utils.clip_grad_norm_([p for g in run.opt.param_groups for p in g["params"]], cfg.max_grad_norm)
    run.scaler.step(run.opt)
    run.scaler.update()
    run.sched.step()
    return losses, denom


def _train_epoch(run: _Run, feats: list[dict[str, Any]], epoch: int) -> tuple[float, int]:
    """One epoch of optimizer steps in its seeded order: the summed training loss and its term count."""
    from tqdm.auto import tqdm

    cfg, per_epoch = run.cfg, run.steps_per_epoch
    run.model.train()
    steps = epoch_steps(
        feats, cfg.batch_size * cfg.grad_accum, random.Random(cfg.seed * 1000 + epoch), cfg.length_buckets
    )
    run_loss, run_n = 0.0, 0
    log_every = max(1, per_epoch // LOG_LINES_PER_EPOCH)
    bar = tqdm(
        range(per_epoch), desc=f"epoch {epoch}/{cfg.epochs}", disable=None if cfg.progress else True, leave=False
    )
    for step in bar:
        losses, n = _step(run, [feats[i] for i in steps[step]], epoch, step)
        for loss in losses:  # one by one, as they came
            run_loss += loss
        run_n += n
        bar.set_postfix(loss=f"{run_loss / run_n:.4f}")
        if (step + 1) % log_every == 0 and step + 1 < per_epoch:
            log.info("epoch %d/%d step %d/%d: train loss %.4f", epoch, cfg.epochs, step + 1, per_epoch,
                     run_loss / max(run_n, 1))  # fmt: skip
        if run.on_progress is not None:
            run.on_progress(((epoch - 1) * per_epoch + step + 1) / max(run.total, 1))
    bar.close()
    return run_loss, run_n


def _validate(run: _Run, batches: list[dict[str, torch.Tensor]]) -> tuple[dict[str, Any], float]:
    """The validation metrics and loss (a union head: over the dataset's own outputs, as in training)."""
    cols, problem, data = run.cols, run.problem, run.data
    logits, labels, val_loss = run_model(run.model, batches, problem if cols is None else None, run.dev, run.amp)
    if cols is not None:
        pairs = [own_outputs(z, y, cols, data.multi_label) for z, y in zip(logits, labels, strict=True)]
        logits = [z for z, _ in pairs]
        terms = sum(y.numel() for _, y in pairs)
        val_loss = sum(float(task_loss(z, y, problem)[0]) for z, y in pairs) / max(1, terms)
    return score_logits(data, data.labels, problem, logits, labels), val_loss


def train_model(
    model: torch.nn.Module,
    data: TaskDataset,
    tokenizer: Any,
    cfg: FinetuneConfig,
    device: str = "cpu",
    on_progress: Callable[[float], None] | None = None,
) -> tuple[torch.nn.Module, list[dict[str, Any]]]:
    """Train a copy of ``model`` (the argument is not modified); return the best copy and per-epoch records.

    Args:
        model: A task model whose head matches ``data`` (see :func:`finetune`).
        data: The task: train, and validation to score the epochs; without validation a seeded slice of train
            (as capped by ``max_train_examples``) is held out for that, never test (:mod:`symfuse.data.holdout`).
        tokenizer: Tokenizer object.
        cfg: Settings.
        device: ``cpu`` or ``cuda[:i]``.
        on_progress: Called with the fraction of optimizer steps done (0..1] after every step.

    Returns:
        ``(trained model, [{"epoch", "train_loss", "split", "val_loss", <val metrics>, "seconds"}, ...])``; nothing
        to score (``split`` None: no validation, under two train records): no ``val_loss``, the last epoch is kept.
    """
    dev = resolve_device(device)
    amp = cfg.amp and dev.type == "cuda"
    where = getattr(model.config, "_name_or_path", "") or "model"
    for name, p in model.state_dict().items():
        check_finite_tensor(p, name, where)
    cols = union_columns(model.config, data, where)  # union head: the outputs of the dataset's own classes
    model = copy.deepcopy(model).to(dev)
    pad = name_padding(model, tokenizer)  # saved in the config: a decoder's classifier finds each row's end by it
    length = readable_length(cfg.max_length, model.config, where)
    selection, train_feats, val_feats = selection_features(data, tokenizer, length, cfg.seed, cfg.max_eval_examples)
    val_split = selection.split  # validation, else a slice held out of train (never test), or None: nothing
    val_batches = list(iter_batches(val_feats, cfg.eval_batch_size, pad, by_length=True))  # metrics: order-free
    fused = cfg.fused_optimizer and dev.type in ("cpu", "cuda")
    run = _Run(
        model, data, cfg, dev, amp,
        torch.bfloat16 if amp and torch.cuda.is_bf16_supported() else torch.float16,
        torch.optim.AdamW(_param_groups(model, cfg), lr=cfg.lr, fused=fused or None),
        cols, data.problem_type if cols is None else "multi_label_classification", pad, where,
        math.ceil(len(train_feats) / (cfg.batch_size * cfg.grad_accum)), on_progress,
    )  # fmt: skip
    history: list[dict[str, Any]] = []
    best_state, best_score, best_epoch = None, (-math.inf, -math.inf), cfg.epochs
    _seed_all(cfg.seed)
    for epoch in range(1, cfg.epochs + 1):
        t0 = time.perf_counter()
        run_loss, run_n = _train_epoch(run, train_feats, epoch)
        train_seconds = time.perf_counter() - t0
        metrics, val_loss = _validate(run, val_batches) if val_split else ({}, math.nan)
        if val_split and not math.isfinite(val_loss):  # the last steps' updates diverged: no epoch to keep
            raise NonFiniteError(
                f"{run.where}: {val_split} loss on {run.data.name} became {val_loss} after epoch {epoch} — nothing "
                f"was written; lower the learning rate (now {cfg.lr:g}) or check the data and the base weights"
            )
        history.append({
            "epoch": epoch, "train_loss": run_loss / max(run_n, 1), "split": val_split,
            **({"val_loss": val_loss, **_scalars(metrics)} if val_split else {}), "train_seconds": train_seconds,
            "train_examples_per_s": len(train_feats) / train_seconds, "seconds": time.perf_counter() - t0,
        })  # fmt: skip
        if not val_split:  # nothing to score: the last epoch is kept
            log.info("epoch %d: train loss %.4f (no validation data)", epoch, history[-1]["train_loss"])
            continue
        primary = metrics["primary"]
        log.info("epoch %d: train loss %.4f, %s loss %.4f, %s %.4f", epoch, history[-1]["train_loss"],
                 "val" if val_split == "validation" else "held-out", val_loss, primary, metrics[primary])  # fmt: skip
        score = (metrics[primary], -val_loss)  # ties on the metric: lower validation loss wins
        if cfg.keep_best and score > best_score:
            best_score, best_epoch = score, epoch
            best_state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    for record in history:  # exactly one record is flagged: the epoch whose weights are returned (none scored: last)
        record["best"] = record["epoch"] == (best_epoch if cfg.keep_best else len(history))
    if best_state is not None and cfg.keep_best:
        model.load_state_dict(best_state)
    return model.cpu().eval(), history


def own_outputs(
    logits: torch.Tensor, labels: torch.Tensor, cols: list[int] | None, multi_label: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Union heads: the logits of the dataset's own classes and multi-hot gold over them; else both unchanged.

    Each class of the union is a binary classifier; a dataset trains (and is scored on) only the classes it has,
    so the loss sees no output of a class the dataset lacks.
    """
    if cols is None:
        return logits, labels
    gold = labels.float() if multi_label else torch.nn.functional.one_hot(labels.long(), len(cols)).float()
    return logits[:, cols], gold


def _count(labels: torch.Tensor, problem: str) -> int:
    if problem == "token_classification":
        return int((labels != -100).sum())
    return labels.numel() if problem in ("multi_label_classification", "regression") else labels.shape[0]


def _scalars(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float, str)) and not isinstance(v, bool)}


def finetune(
    base: str | Path,
    data: str,
    out: Path,
    cfg: FinetuneConfig | None = None,
    device: str = "cpu",
    overwrite: bool = False,
    on_progress: Callable[[float], None] | None = None,
) -> Path:
    """Fine-tune ``base`` on ``data`` and write a ``save_pretrained`` folder (safetensors) + tokenizer + report.

    The head is ``AutoModelForSequenceClassification`` (single-label, multi-label with one sigmoid output per class,
    or 1-output regression) or ``AutoModelForTokenClassification`` (NER); ``config.id2label`` holds the class names.
    ``symfuse_train.json`` holds the per-epoch metrics, seconds, the config, the data fingerprint and ``selection``
    (the records that scored the epochs: ``validation``, else ``train_holdout``; see :mod:`symfuse.data.holdout`).

    Args:
        base: Base checkpoint folder, ``"minilm"`` or a hub id (its tokenizer files must be in the folder).
        data: Dataset source (see :func:`symfuse.data.load_task_dataset`).
        out: Output folder (written atomically).
        cfg: Settings (defaults: :class:`FinetuneConfig`).
        device: ``cpu`` or ``cuda[:i]`` (CPU fallback when CUDA is absent).
        overwrite: Replace an existing ``out``.
        on_progress: Called with the fraction of training done (0..1] after every optimizer step (e.g. to update a
            progress bar in an orchestrator; the library itself logs the loss ~10 times per epoch at INFO).

    Returns:
        ``out``.

    Raises:
        OutputExistsError: ``out`` exists and ``overwrite`` is False (checked before any training).
    """
    cfg = cfg or FinetuneConfig()
    t0 = time.perf_counter()
    check_output(out, overwrite, inputs=[base, data])
    base_path = validate_checkpoint(base, finite=True, tokenizer=True)  # before any data is read
    tok = load_tokenizer(base_path)
    ds = load_task_dataset(data, max_train_examples=cfg.max_train_examples, seed=cfg.seed)
    few = too_few_classes(ds.task, ds.multi_label, ds.labels) if cfg.label_space is None else None
    if few:
        raise DatasetError(f"{data}: {few}")
    if cfg.label_space is not None:  # before any model is built: the union must hold the dataset's classes
        if ds.task not in ("classification", "pair_classification"):
            raise ValueError(f"{data}: union labels need a classification dataset, not {ds.task}")
        try:
            columns_of(ds.labels, cfg.label_space)
        except ValueError as exc:
            raise ValueError(f"{data}: {exc}; build the union from every training dataset") from None
    selection = epoch_selection(ds, cfg.seed)  # the split train_model scores the epochs on, for the report
    with _TRAIN_LOCK:  # reproducible from cfg.seed also when other threads fine-tune (see _TRAIN_LOCK)
        model, history = train_model(_build_model(base_path, ds, cfg), ds, tok, cfg, device, on_progress)
    report = {
        "base": str(base),
        "data": str(data),
        "dataset": ds.name,
        "problem_type": ds.problem_type,
        "labels": ds.labels,
        "label_space": "per-dataset" if cfg.label_space is None else "union",
        "train_examples": len(selection.train),  # the held-out slice trains nothing
        "selection": selection.to_json(cfg.max_eval_examples),
        "data_fingerprint": ds.fingerprint,
        "config": cfg.model_dump(),
        "device": str(resolve_device(device)),
        "epochs": history,
        "best_epoch": next(h["epoch"] for h in history if h["best"]),
        "seconds": time.perf_counter() - t0,
    }
    with atomic_output_dir(out, overwrite=overwrite) as tmp:
        model.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        (tmp / TRAIN_REPORT).write_text(json.dumps(report, indent=2))
    log.info("fine-tuned %s on %s -> %s (%.1fs)", base, ds.name, out, report["seconds"])
    return Path(out)
