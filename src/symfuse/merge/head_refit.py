"""Head refit: each task head of a merged model re-fitted, in closed form, to the merged body's own features.

A merge moves the body's features, and each model's kept head then reads features it was never trained on. For
every head of the merged model and each model that head serves (per-dataset heads: model ``i``'s own head; one
shared head: every model), on that model's own data (the statistics' seeded subset), take the output layer's input
on the merged model ``X`` (``N x d``, a constant column appended for the bias) and the source model's own logits
``Y`` (``N x C``). The new weights ``Θ = [W, b]`` minimise

    ||X Θᵀ - Y||² + λ ||Θ - Θ₀||²,   λ = ridge · tr(XᵀX) / (d + 1)

with ``Θ₀`` the head as merged, i.e. ``Θᵀ = (XᵀX + λI)⁻¹ (XᵀY + λ Θ₀ᵀ)``: a closed-form distillation of each source
model's logits into the merged body; no label is read. Properties the tests check:

* a head whose merged body IS its model's body (no other model moved it) is returned unchanged, for any ridge;
* the fit's logit error on its data is never above the kept head's (the kept head is a feasible point);
* ``ridge → ∞`` keeps the head; ``ridge → 0`` is the least-squares fit.

With union heads (one head over every dataset's classes), class ``c``'s row is fitted on the models that learned
``c`` only (RegMean paper, Appendix B), a row no model learned is kept. Tokens (NER) count one row per non-padding
token; sequences one row per example.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator
from torch import nn

from symfuse.errors import CheckpointError, NonFiniteError
from symfuse.fields import no_bool_for_numbers
from symfuse.seeds import Seed

log = logging.getLogger(__name__)


@dataclass
class HeadFit:
    """The normal equations of one head's least-squares fit, one entry per model the head serves.

    Kept per model, not summed: with union heads each class sums only the models that learned it.

    Attributes:
        grams: ``(d+1, d+1)`` each: ``XᵀX`` of the merged features on that model's data (with a ones column).
        crosses: ``(d+1, C)`` each: ``XᵀY`` with that model's own logits.
        squares: ``(C,)`` each: ``Σ y²`` per class (for the fit's error only).
        rows: Feature rows each.
        masks: ``(C,)`` bool each: the classes that model's logits are targets for.
    """

    grams: list[torch.Tensor] = field(default_factory=list)
    crosses: list[torch.Tensor] = field(default_factory=list)
    squares: list[torch.Tensor] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    masks: list[torch.Tensor] = field(default_factory=list)

    def error(self, theta: torch.Tensor) -> float:
        """Mean squared logit error of the head ``theta`` (``(C, d+1)``) over every fitted (row, class) pair."""
        total, count = 0.0, 0
        for gram, cross, sq, n, mask in zip(self.grams, self.crosses, self.squares, self.rows, self.masks, strict=True):
            t = theta[mask]
            quad = torch.einsum("ci,ij,cj->", t, gram, t) - 2 * torch.einsum("ic,ci->", cross[:, mask], t)
            total += float(quad + sq[mask].sum())
            count += n * int(mask.sum())
        return max(total, 0.0) / max(count, 1)


def solve_head(
    weight: torch.Tensor, bias: torch.Tensor | None, fit: HeadFit, ridge: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The refitted ``(weight, bias)`` of one output layer (see the module docstring), in the input dtypes.

    Args:
        weight: ``(C, d)`` the head as merged.
        bias: ``(C,)`` or None (then no ones column was used: ``fit`` is ``d x d``).
        fit: The summed normal equations; a class no model fits keeps its row.
        ridge: Pull towards the merged head, relative to the features' mean squared norm; > 0.

    Raises:
        ValueError: ``ridge`` is not positive, or ``fit`` does not match the head's shape.
    """
    if not ridge > 0:
        raise ValueError(f"head refit: ridge must be > 0, got {ridge}")
    theta0 = weight.detach().to(torch.float64)
    if bias is not None:
        theta0 = torch.cat([theta0, bias.detach().to(torch.float64)[:, None]], dim=1)  # (C, d+1)
    c, d1 = theta0.shape
    if any(g.shape != (d1, d1) for g in fit.grams) or any(x.shape != (d1, c) for x in fit.crosses):
        raise ValueError(f"head refit: statistics of shape {fit.grams[0].shape} for a ({c}, {d1}) head")
    out = theta0.clone()
    masks = torch.stack(fit.masks) if fit.masks else torch.zeros(0, c, dtype=torch.bool)
    groups: dict[tuple[int, ...], list[int]] = {}  # classes fitted by the same models share one system
    for j in range(c):
        who = tuple(int(i) for i in torch.nonzero(masks[:, j]).flatten()) if len(masks) else ()
        if who:
            groups.setdefault(who, []).append(j)
    eye = torch.eye(d1, dtype=torch.float64)
    for who, cols in groups.items():
        gram = sum(fit.grams[i] for i in who)
        cross = sum(fit.crosses[i] for i in who)[:, cols]
        lam = ridge * float(torch.diagonal(gram).sum()) / d1
        system = gram + lam * eye
        rhs = cross + lam * theta0[cols].T
        out[cols] = torch.linalg.solve(system, rhs).T
    new_w = out[:, : weight.shape[1]].to(weight.dtype)
    new_b = out[:, -1].to(bias.dtype) if bias is not None else None
    return new_w, new_b


def check_refittable(path: Path, config: Any, shapes: dict[str, tuple[int, ...]]) -> None:
    """Refuse, before any heavy work, a checkpoint without a classification output layer to refit.

    Args:
        path: The checkpoint folder (for the message).
        config: Its config (``num_labels``).
        shapes: Its head tensors' shapes (tensors outside the base model).

    Raises:
        CheckpointError: no 2-D head weight with ``num_labels`` rows (a bare body, or a language-model head).
    """
    n = int(getattr(config, "num_labels", 0) or 0)
    if not any(name.endswith(".weight") and len(s) == 2 and s[0] == n for name, s in shapes.items()):
        raise CheckpointError(
            f"{path}: no classification head with {n} outputs to refit — refit heads only for task-head models "
            "(sequence or token classification), or drop the head refit"
        )


def output_layer(model: nn.Module, head_tensors: set[str]) -> tuple[str, nn.Linear]:
    """The classification output layer: the last linear head module with ``config.num_labels`` outputs.

    Raises:
        CheckpointError: the model has no such layer (a bare body, or a language-model head).
    """
    n = int(getattr(model.config, "num_labels", 0) or 0)
    found = [
        (path, mod)
        for path, mod in model.named_modules()
        if isinstance(mod, nn.Linear) and f"{path}.weight" in head_tensors and mod.out_features == n
    ]
    if not found:
        raise CheckpointError(
            f"head refit: {type(model).__name__} has no classification output layer with {n} outputs among its "
            "head tensors — refit heads only for task-head models (sequence or token classification)"
        )
    return found[-1]


def _rows(features: torch.Tensor, logits: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten per-token outputs to the non-padding rows; per-example outputs pass through."""
    if features.dim() == 3:  # (batch, tokens, d): token classification
        keep = mask.bool() if mask is not None else torch.ones(features.shape[:2], dtype=torch.bool)
        return features[keep], logits[keep]
    return features, logits


@torch.no_grad()
def accumulate(
    merged: nn.Module,
    source: nn.Module,
    layer: nn.Linear,
    batches: Sequence[dict[str, torch.Tensor]],
    device: torch.device | str,
    with_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """``(XᵀX, XᵀY, Σy², rows)`` of one model's data: merged features at ``layer``'s input, the source's logits."""
    from symfuse.stats.gram import model_inputs

    seen: list[torch.Tensor] = []
    handle = layer.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach()))
    d = layer.in_features + (1 if with_bias else 0)
    gram = torch.zeros(d, d, dtype=torch.float64, device=device)
    cross = torch.zeros(d, layer.out_features, dtype=torch.float64, device=device)
    squares = torch.zeros(layer.out_features, dtype=torch.float64, device=device)
    rows = 0
    try:
        for batch in batches:
            inputs = model_inputs(batch, device)
            seen.clear()
            merged(**inputs)
            teacher = source(**inputs).logits
            x, y = _rows(seen[-1], teacher, inputs.get("attention_mask"))
            x = x.to(torch.float64)
            if with_bias:
                x = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device)], dim=1)
            y = y.to(torch.float64)
            gram += x.T @ x
            cross += x.T @ y
            squares += (y * y).sum(0)
            rows += x.shape[0]
    finally:
        handle.remove()
    return gram.cpu(), cross.cpu(), squares.cpu(), rows


def refit_heads(
    merged: Path,
    folders: dict[str, str],
    models: Sequence[Path],
    batches: Sequence[Sequence[dict[str, torch.Tensor]]],
    ridge: float = 0.1,
    learned: torch.Tensor | None = None,
    device: str | torch.device = "cpu",
) -> dict[str, Any]:
    """Refit every head of a merged checkpoint folder in place (see the module docstring).

    Args:
        merged: The merged folder (:func:`~symfuse.merge.merge_checkpoints`'s output, not yet published).
        folders: Model name -> its head's sub-folder of ``merged`` (``"."`` for the top); every model maps to
            ``"."`` when the merged model has one head.
        models: The K source checkpoints, in ``folders``' order (their logits are the targets).
        batches: Per model, its own data (:func:`symfuse.data.make_batches`).
        ridge: See :func:`solve_head`.
        learned: ``(K, C)`` bool for union heads: which model learned which class; None: every class.
        device: Where the forward passes run.

    Returns:
        ``{"ridge", "heads": {sub-folder: {"layer", "rows", "logit_mse_before", "logit_mse_after"}}}``.

    Raises:
        CheckpointError: a head without a classification output layer.
    """
    from symfuse.checkpoint import CheckpointReader, load_hf_model
    from symfuse.merge.heads import head_names

    names = list(folders)
    if len(names) != len(models) or len(batches) != len(models):
        raise ValueError(f"head refit: {len(names)} heads, {len(models)} models, {len(batches)} datasets")
    report: dict[str, Any] = {"ridge": ridge, "heads": {}}
    by_folder: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        by_folder.setdefault(folders[name], []).append(i)
    for rel, served in by_folder.items():
        folder = merged / rel
        with CheckpointReader(folder) as reader:
            heads = head_names(reader)
        net = load_hf_model(folder, validate=False).to(device)
        path, layer = output_layer(net, heads)
        with_bias = layer.bias is not None
        fit = HeadFit()
        for i in served:
            source = load_hf_model(models[i], validate=False).to(device)
            gram, cross, squares, n = accumulate(net, source, layer, batches[i], device, with_bias)
            del source
            fit.grams.append(gram)
            fit.crosses.append(cross)
            fit.squares.append(squares)
            fit.rows.append(n)
            every = torch.ones(layer.out_features, dtype=torch.bool)
            fit.masks.append(learned[i].to(torch.bool).clone() if learned is not None else every)
        new_w, new_b = solve_head(layer.weight, layer.bias, fit, ridge)
        if not (torch.isfinite(new_w).all() and (new_b is None or torch.isfinite(new_b).all())):
            raise NonFiniteError(
                f"{folder}: the refitted head {path} is not finite (NaN / inf features or logits on the refit data) "
                "— check the models' outputs on their data, or merge without the head refit"
            )
        replace = {f"{path}.weight": new_w} | ({f"{path}.bias": new_b} if new_b is not None else {})
        report["heads"][rel] = {
            "layer": path,
            "models": [names[i] for i in served],
            "rows": sum(fit.rows),
            "logit_mse_before": fit.error(_theta(layer.weight, layer.bias)),
            "logit_mse_after": fit.error(_theta(new_w, new_b)),
        }
        del net
        _replace_tensors(folder, replace)
        log.info("head refit %s (%s): logit MSE %.4g -> %.4g on %d rows", rel, path,
                 report["heads"][rel]["logit_mse_before"], report["heads"][rel]["logit_mse_after"],
                 report["heads"][rel]["rows"])  # fmt: skip
    return report


def _theta(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    w = weight.detach().to(torch.float64).cpu()
    return torch.cat([w, bias.detach().to(torch.float64).cpu()[:, None]], dim=1) if bias is not None else w


def _replace_tensors(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Rewrite the weight file(s) of ``folder`` holding ``tensors``, atomically per file (metadata kept)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from symfuse.io import open_weight_files, save_safetensors

    files = open_weight_files(folder)[0]
    for file in sorted({files[n] for n in tensors}):
        with safe_open(str(file), framework="pt") as fh:
            meta = fh.metadata()
        state = load_file(str(file))
        for n, t in tensors.items():
            if files[n] == file:
                state[n] = t.to(state[n].dtype).contiguous()
        save_safetensors(state, file, metadata=meta)


class RefitOptions(BaseModel):
    """What a head refit reads and how (:func:`refit_heads`); the merge's ``head_refit`` argument.

    Attributes:
        data: One dataset per model (its own data), in merge order.
        ridge: See :func:`solve_head`.
        split: The split read.
        max_examples: Seeded subset of each dataset (as the statistics take it); None: all of it.
        batch_size: Examples per forward pass.
        max_length: Token cap per example.
        seed: Seed of the subset.
        device: Where the forward passes run.
    """

    model_config = ConfigDict(extra="forbid")
    _no_bool = field_validator("*", mode="before")(no_bool_for_numbers)

    data: list[str] = Field(min_length=1)
    ridge: float = Field(default=0.1, gt=0)
    split: str = "train"
    max_examples: int | None = Field(default=256, gt=0)
    batch_size: int = Field(default=16, gt=0)
    max_length: int = Field(default=128, gt=0)
    seed: Seed = 13
    device: str = "cpu"


def refit_batches(models: Sequence[Path], options: RefitOptions) -> list[list[dict[str, torch.Tensor]]]:
    """Each model's batches for :func:`refit_heads`: every dataset loaded and tokenised (before any heavy work).

    Raises:
        ValueError: ``options.data`` does not give one dataset per model.
        DataError: a dataset cannot be loaded.
        TokenizerError: a model folder has no tokenizer.
    """
    from symfuse.data import batches_per_model

    if len(options.data) != len(models):
        raise ValueError(
            f"head refit reads each model's own data: {len(options.data)} dataset(s) for {len(models)} models — "
            "give one per model, in order"
        )
    o = options
    return batches_per_model(o.data, models, o.split, o.batch_size, o.max_length, o.max_examples, o.seed)
