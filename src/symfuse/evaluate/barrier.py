"""Loss barriers along the straight line between two models' parameters.

``θ(λ) = (1-λ)·θ_A + λ·θ_B``; the barrier is ``max_λ [L(θ(λ)) − ((1-λ)·L(θ_A) + λ·L(θ_B))]`` (0 for a model with
itself, positive when the path climbs over a ridge). :func:`interpolation_losses` is the reusable core: any models
of one architecture and any ``loss_fn(module) -> float`` (task loss, MLM loss, ...). It never modifies its inputs.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from symfuse.checkpoint import CheckpointReader
from symfuse.data import iter_batches, load_task_dataset
from symfuse.data.batches import encode_split, padding_id, readable_length
from symfuse.data.dataset import TaskDataset
from symfuse.data.labels import differ_in_classes, head_targets
from symfuse.data.text import is_language_modeling, text_dataset_name, text_split
from symfuse.data.vocab import check_same_vocabulary
from symfuse.device import resolve_device
from symfuse.errors import CheckpointError, overflowed
from symfuse.evaluate.evaluate import write_json_atomic
from symfuse.evaluate.predict import head_problem_type, load_task_model, run_model
from symfuse.io import tensor_difference

log = logging.getLogger(__name__)

StateDict = Mapping[str, torch.Tensor]


def default_lambdas(points: int = 21) -> list[float]:
    """``points`` evenly spaced λ in [0, 1] (21 -> 0, 0.05, ..., 1)."""
    if points < 2:
        raise ValueError("points must be at least 2 (the two end models)")
    return [i / (points - 1) for i in range(points)]


def interpolate_state(a: StateDict, b: StateDict, lam: float) -> dict[str, torch.Tensor]:
    """New tensors ``(1-λ)·a + λ·b`` for floating entries; other entries (integer buffers) are copied from ``a``.

    Raises:
        ValueError: if the two state dicts differ in names or shapes.
    """
    if set(a) != set(b):
        diff = sorted(set(a) ^ set(b))[:5]
        raise ValueError(f"models differ in parameters {diff}: interpolation needs one architecture and head shape")
    out = {}
    for name, ta in a.items():
        tb = b[name]
        if ta.shape != tb.shape:
            raise ValueError(f"{name}: shapes {tuple(ta.shape)} and {tuple(tb.shape)} differ; heads must match")
        if ta.is_floating_point():
            out[name] = torch.lerp(ta.float(), tb.float().to(ta.device), lam).to(ta.dtype)
        else:
            out[name] = ta.clone()
    return out


def interpolation_losses(
    model_a: torch.nn.Module | StateDict,
    model_b: torch.nn.Module | StateDict,
    loss_fn: Callable[[torch.nn.Module], float],
    lambdas: Sequence[float] | None = None,
    template: torch.nn.Module | None = None,
    label: str = "A -> B",
) -> list[float]:
    """``loss_fn`` of the interpolated model at each λ (λ=0 is A, λ=1 is B). Inputs are never modified.

    Args:
        model_a: Module or state dict.
        model_b: Module or state dict of the same architecture.
        loss_fn: ``module -> loss`` (e.g. mean task loss or masked-LM loss on a fixed set of batches).
        lambdas: Interpolation weights (default: 21 points 0, 0.05, ..., 1).
        template: Module to load the interpolated weights into when both inputs are state dicts (it is copied).
        label: The two models, in the error for a loss that is NaN / inf.

    Returns:
        One loss per λ.

    Raises:
        NonFiniteError: a loss came out NaN / inf.
    """
    lambdas = list(lambdas) if lambdas is not None else default_lambdas()
    sd_a = model_a.state_dict() if isinstance(model_a, torch.nn.Module) else model_a
    sd_b = model_b.state_dict() if isinstance(model_b, torch.nn.Module) else model_b
    base = template if template is not None else (model_a if isinstance(model_a, torch.nn.Module) else None)
    if base is None:
        raise ValueError("interpolation_losses: give a template module when both models are state dicts")
    work = copy.deepcopy(base)  # the callers' modules keep their weights
    work.eval()
    losses = []
    for lam in lambdas:
        work.load_state_dict(interpolate_state(sd_a, sd_b, float(lam)))
        losses.append(float(loss_fn(work)))
        if not math.isfinite(losses[-1]):
            raise overflowed(label, f"the loss at λ={lam:.2f} (λ=0 is the first model)")
        log.debug("λ=%.3f loss=%.5f", lam, losses[-1])
    return losses


def barrier_from_losses(lambdas: Sequence[float], losses: Sequence[float]) -> dict:
    """Barrier height, where it peaks, and the excess over the linear path at each λ."""
    l0, l1 = losses[0], losses[-1]
    excess = [loss - ((1 - lam) * l0 + lam * l1) for lam, loss in zip(lambdas, losses, strict=True)]
    i = max(range(len(excess)), key=excess.__getitem__)
    return {"barrier": float(excess[i]), "argmax_lambda": float(lambdas[i]), "excess": [float(e) for e in excess]}


def plot_barrier(lambdas: Sequence[float], losses: Sequence[float], file: Path, title: str = "") -> Path:
    """Save the loss curve and the linear reference as a PNG (matplotlib Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(lambdas, losses, "o-", label="loss((1-λ)θ_A + λθ_B)")
    ax.plot([lambdas[0], lambdas[-1]], [losses[0], losses[-1]], "--", color="grey", label="linear")
    ax.set_xlabel("λ")
    ax.set_ylabel("loss")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(file, dpi=120)
    plt.close(fig)
    return file


def loss_barrier(
    a: str | Path,
    b: str | Path,
    data: str,
    out_dir: Path,
    points: int = 21,
    split: str = "test",
    max_examples: int | None = None,
    batch_size: int = 64,
    max_length: int = 128,
    seed: int = 13,
    device: str = "cpu",
) -> dict:
    """Task-loss barrier between two task models on a dataset split; writes ``barrier.json`` and ``barrier.png``.

    On a language-modelling dataset the models are causal LMs and the loss is the mean next-token NLL.

    Args:
        a: First checkpoint (λ = 0); its tokenizer encodes the data.
        b: Second checkpoint (λ = 1), same architecture and head shape.
        data: Dataset source (one the models were fine-tuned on): its classes are matched to the heads' outputs by
            name (a head without names, ``LABEL_i``: class i is output i).
        out_dir: Output folder (created).
        points: Number of λ values in [0, 1].
        split: Dataset split.
        max_examples: Seeded random subset of the split.
        batch_size: Batch size.
        max_length: Truncation length.
        seed: Subset seed.
        device: ``cpu`` or ``cuda[:i]``.

    Returns:
        ``{"barrier", "argmax_lambda", "lambdas", "losses", "excess", ...}`` (also in ``barrier.json``).

    Raises:
        CheckpointError: models of other tensors, or heads naming their classes differently.
        DatasetError: data with a class the heads lack.
    """
    t0 = time.perf_counter()
    dev = resolve_device(device)
    check_same_tensors(a, b)
    check_same_vocabulary([a, b], "the models along the path read the data as the first model's tokens")
    if is_language_modeling(str(data)):
        model_a, model_b, loss_fn, name = _lm_loss(a, b, str(data), split, max_examples, batch_size, max_length, seed,
                                                   dev)  # fmt: skip
    else:
        model_a, model_b, loss_fn, name = _task_loss(a, b, data, split, max_examples, batch_size, max_length, seed,
                                                     dev)  # fmt: skip
    lambdas = default_lambdas(points)
    losses = interpolation_losses(model_a, model_b, loss_fn, lambdas, label=f"{a} -> {b}")
    result = {
        "a": str(a),
        "b": str(b),
        "data": str(data),
        "split": split,
        "max_examples": max_examples,
        "lambdas": lambdas,
        "losses": losses,
        **barrier_from_losses(lambdas, losses),
    }
    result["seconds"] = time.perf_counter() - t0
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(result, out_dir / "barrier.json")
    plot_barrier(lambdas, losses, out_dir / "barrier.png", f"{Path(a).name} → {Path(b).name} on {name}/{split}")
    log.info("barrier %s -> %s on %s: %.4f at λ=%.2f", a, b, name, result["barrier"], result["argmax_lambda"])
    return result


def check_same_tensors(a: str | Path, b: str | Path) -> None:
    """Refuse two checkpoints whose tensors differ in names or shapes (headers only), naming both and the tensor.

    Raises:
        CheckpointError: a head of another label set, or another architecture.
    """
    with CheckpointReader(a) as ra, CheckpointReader(b) as rb:
        if diff := tensor_difference(ra, rb):
            raise CheckpointError(f"{diff} — the barrier interpolates two models of one architecture and one label "
                                  "set")  # fmt: skip


LossSetup = tuple[torch.nn.Module, torch.nn.Module, Callable[[torch.nn.Module], float], str]


def head_space(config_a: Any, config_b: Any, ds: TaskDataset, models: tuple[Any, Any]) -> list[str] | None:
    """The label space both heads' targets index (:func:`~symfuse.data.labels.target_space`): one, or an error.

    Raises:
        CheckpointError: heads naming their classes differently (another label set or order).
        DatasetError: data whose classes the heads lack.
    """
    if differ := differ_in_classes(config_a, config_b):
        raise CheckpointError(f"{models[0]} and {models[1]}: {differ} — a straight path needs one label set, in one "
                              "order")  # fmt: skip
    return head_targets(config_a, ds, models[0], "give the dataset the models were fine-tuned on")


def _task_loss(a, b, data, split, max_examples, batch_size, max_length, seed, dev: torch.device) -> LossSetup:
    """Two task models and the mean task loss on a fixed set of batches of the split."""
    model_a, tok = load_task_model(a, str(dev))
    model_b, _ = load_task_model(b, str(dev))
    problem = head_problem_type(model_a.config)
    ds = load_task_dataset(data)
    space = head_space(model_a.config, model_b.config, ds, (a, b))
    length = readable_length(max_length, model_a.config, a)
    batches = list(
        iter_batches(
            encode_split(ds, tok, split, length, max_examples, seed, space),
            batch_size,
            padding_id(tok, model_a.config),
            by_length=True,  # the mean loss is order-free: batch similar lengths, pad little
        )
    )
    return model_a, model_b, lambda m: run_model(m, batches, problem, dev, amp=dev.type == "cuda")[2], ds.name


def _lm_loss(a, b, data, split, max_examples, batch_size, max_length, seed, dev: torch.device) -> LossSetup:
    """Two causal LMs and the mean next-token loss of the split's texts (a language-modelling dataset)."""
    from symfuse.evaluate.language import load_causal_lm, next_token_nll

    model_a, tok = load_causal_lm(str(a), dev)
    model_b, _ = load_causal_lm(str(b), dev)
    texts = text_split(data, split, max_examples, seed)

    def loss_fn(m: torch.nn.Module) -> float:
        total, count = next_token_nll(m, tok, texts, dev, batch_size, max_length)
        return total / max(count, 1)

    return model_a, model_b, loss_fn, text_dataset_name(data)
