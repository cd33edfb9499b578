"""RegMean (Jin et al., 2023): per linear layer, the weights minimising the summed regression error on all inputs.

For ``nn.Linear`` ``y = x W^T`` (``W`` (out, in)) with input Grams ``G_i = X_i^T X_i / n_i`` (in, in):

    W^T = S^-1 sum_i c_i G_i' W_i^T,     S = sum_i c_i G_i',     G_i' = alpha G_i + (1 - alpha) diag(G_i)

(``alpha`` scales the off-diagonal entries). GPT-2 ``Conv1D`` stores ``W^T`` (in, out) directly, so the same
formula applies without the transposes. With ``c_i = n_i`` and ``alpha = 1`` this is the least-squares fit on the
concatenated data. Tensors that are not linear weights with Grams (embeddings, norms, biases) get the weighted
mean.

How it is computed (exact algebra, cheaper and numerically kinder than the formula above):

* Delta form. With ``Wbar = sum_i c_i W_i / sum_i c_i`` and ``D_i = W_i - Wbar`` (so ``sum_i c_i D_i = 0``),

      W^T = Wbar^T + S^-1 B,     B = sum_{i != r} c_i (G_i' - G_r') D_i^T

  for any reference model ``r`` (the one with the largest weight): K - 1 products instead of K, and the solve
  only produces a correction of the size of the deltas, so its rounding error is relative to ``D``, not ``W``.
  Identical Grams give ``B = 0`` exactly (the plain mean); K copies of one model give that model.
* One factorisation per input: ``S`` is factored once by Cholesky (``dtype``, float64 by default) and reused by
  every layer reading the same input (q / k / v, recorded as ``same_input`` in the Gram file); when ``S`` is
  not positive definite the correction is solved by ``lstsq`` in float64 (logged, counted).
* In place: the products and the factorisation run in the system's own buffers (torch's ``addmm_`` and
  ``cholesky_ex``); the solve is two triangular solves (1.5-2x faster than ``cholesky_solve``, which copies the
  factor). The means and deltas, and the Gram systems (:mod:`symfuse.merge.gram_systems`), are built in one fused
  pass over the K inputs read span by span.
* Correction precision (``delta_dtype``): ``same`` computes ``B`` in ``dtype``; ``bfloat16`` computes it with
  bfloat16 inputs (float32 accumulation, one product over the K - 1 models), about 2x faster on CPUs with
  bfloat16 dot products; ``auto`` uses bfloat16 only when the predicted relative error
  ``2^-8 * max_i ||D_i|| / ||Wbar|| * cond`` (``cond`` >= cond(S), estimated from the Cholesky diagonal) is
  below ``bf16_tol``. bfloat16 rounding of ``B`` is amplified by the solve like any noise in ``B``, so the
  rule asks for small deltas AND a well-conditioned summed Gram: fine-tunes of one base with moderately
  conditioned Grams qualify; independent models (deltas as large as the weights) never do.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Literal

import torch
from pydantic import Field, model_validator

from symfuse.merge import gram_systems
from symfuse.merge.base import Chunks, MergeParams, Merger, TensorInputs, spans, weighted_mean
from symfuse.merge.gram_systems import GramSystem, gram_system
from symfuse.merge.regmean_plain import PlainSystem
from symfuse.stats.io import BufferPool

log = logging.getLogger(__name__)

BF16_UNIT = 2.0**-8  # bfloat16 unit roundoff (8 significant bits)


class RegMeanParams(MergeParams):
    """RegMean parameters."""

    alpha: float = Field(default=0.9, ge=0, le=1)  # off-diagonal scale of each Gram
    dtype: Literal["float64", "float32"] = "float64"  # Gram sum, Cholesky factor and solve precision
    delta_dtype: Literal["same", "bfloat16", "auto"] = "same"  # precision of the correction products (see module)
    bf16_tol: float = Field(default=1e-6, gt=0, lt=1)  # auto: largest predicted relative error of bf16 products

    @model_validator(mode="after")
    def _tol_read_by_auto(self) -> RegMeanParams:
        if "bf16_tol" in self.model_fields_set and self.delta_dtype != "auto":  # it changed nothing
            raise ValueError(f"bf16_tol is read only with delta_dtype auto (delta_dtype is {self.delta_dtype}) — set "
                             "delta_dtype auto, or drop bf16_tol")  # fmt: skip
        return self


def regmean_apply(
    system: GramSystem,
    weights: Sequence[torch.Tensor],
    conv1d: bool = False,
    delta_dtype: Literal["same", "bfloat16", "auto"] = "same",
    bf16_tol: float = 1e-6,
    *,
    finite: list[bool] | None = None,
) -> tuple[torch.Tensor, str]:
    """Merge one linear layer's K weights with a factored :class:`GramSystem` of their input.

    Three passes: the weighted mean and the deltas (one fused pass over the K weights), the correction
    ``S^-1 B`` (products and two triangular solves), and the correction added to the mean in the stored dtype.

    Args:
        system: From :func:`gram_system` (same models, same order).
        weights: K weights, (out, in) (``nn.Linear``) or (in, out) (``conv1d``); a lazy sequence is read once.
        conv1d: Weights are stored (in, out).
        delta_dtype: Precision of the correction products (see the module docstring).
        bf16_tol: ``auto``: largest predicted relative error accepted for bfloat16 products.
        finite: When given, ``True`` is appended if the output is known to be all finite: its sum is
            taken in the last pass over it (the correction added, the stored dtype written), while each chunk is
            in cache. Nothing is appended when the sum is not finite (NaN / inf, or the sum's overflow: each
            chunk is summed in float32 unless the output is float64; the caller then checks element by element).

    Returns:
        ``(merged weight in the input layout and dtype, precision used for the products)``.

    Raises:
        ValueError: if shapes disagree (the message names them).
    """
    chunks = _weight_chunks(system, weights, conv1d)
    mean, deltas = _mean_and_deltas(system, chunks)
    used = _products_dtype(system, mean, deltas, delta_dtype, bf16_tol)
    x = _correction(system, deltas, conv1d, used, mean.shape) if deltas else None
    if x is not None and conv1d:
        mean.add_(x.T)
        x = None
    return _finish(mean, x, chunks.stored[0], finite), used


def _weight_chunks(system: GramSystem, weights: Sequence[torch.Tensor], conv1d: bool) -> Chunks:
    """The K weights read in chunks of the solve dtype, their shapes checked against the Gram and each other."""
    n_in = system.summed.shape[0]
    chunks = Chunks(weights, system.pool, "weight.in", system.summed.dtype)  # the stored layout, chunks in dtype
    shape = chunks.shapes[0]
    for sh in chunks.shapes:
        if len(sh) != 2 or (sh[0] if conv1d else sh[-1]) != n_in or sh != shape:
            raise ValueError(f"regmean: weight {sh} does not match Gram ({n_in}, {n_in}) and weight {shape}")
    return chunks


def _mean_and_deltas(system: GramSystem, chunks: Chunks) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """``Wbar = sum_i c_i W_i / sum_i c_i`` and ``D_i = W_i - Wbar`` for the models with a Gram difference.

    One fused pass: every model's chunk is in cache while the mean's chunk and the deltas' are written.
    """
    dtype, shape = system.summed.dtype, chunks.shapes[0]
    total = sum(system.weights)
    share = [ci / total for ci in system.weights]
    mean = torch.empty(shape, dtype=dtype)
    others = [i for i, d in enumerate(system.diffs) if d is not None]
    deltas = {i: _take(system.pool, f"weight{i}", shape, dtype) for i in others}
    flat_m, flat_d = mean.view(-1), {i: d.view(-1) for i, d in deltas.items()}

    def one(s: int, e: int) -> None:
        w, m = chunks(s, e), flat_m[s:e]
        torch.mul(w[0], share[0], out=m)
        for w_, a in zip(w[1:], share[1:], strict=True):
            m.add_(w_, alpha=a)
        for i in others:
            torch.sub(w[i], m, out=flat_d[i][s:e])

    spans(one, chunks.numel, parallel=True)
    return mean, deltas


def _products_dtype(
    system: GramSystem, mean: torch.Tensor, deltas: dict[int, torch.Tensor], delta_dtype: str, bf16_tol: float
) -> str:
    """The precision of the correction products: ``none`` (no correction), bfloat16 or the solve dtype."""
    if not deltas:
        return "none"
    if delta_dtype != "same":
        ratio = max(float(d.norm()) for d in deltas.values()) / (float(mean.norm()) or 1.0)
        if delta_dtype == "bfloat16" or BF16_UNIT * ratio * system.cond <= bf16_tol:
            return "bfloat16"
    return str(system.summed.dtype).removeprefix("torch.")


def _correction(
    system: GramSystem, deltas: dict[int, torch.Tensor], conv1d: bool, used: str, shape: torch.Size
) -> torch.Tensor:
    """``X^T = B^T S^-1`` (out, in), row-major, with ``B^T = sum_i c_i D_i (G_i' - G_r')`` (``D_i^T`` for conv1d).

    The weights stay in the stored layout; the products go into ``B^T`` (out, in) row-major, nn.Linear's layout,
    which the solve reads as the column-major (in, out) right-hand side (the Grams are symmetric).
    """
    dtype, c = system.summed.dtype, system.weights
    b = _take(system.pool, "rhs", (shape[1], shape[0]) if conv1d else shape, dtype)  # B^T (out, in)
    if used == "bfloat16":  # one product over the K - 1 models: [c_1 D_1 .. c_m D_m] @ [dG_1; ..; dG_m]
        dg = system.bf16_diffs()  # (m in, in)
        dd = torch.cat([d.mul(c[i]).to(torch.bfloat16) for i, d in deltas.items()], dim=0 if conv1d else 1)
        b.copy_((dg.T @ dd).T if conv1d else dd @ dg)  # (in, m in) @ (m in, out); dG^T = dG
        del dd
    else:
        for j, (i, d) in enumerate(deltas.items()):  # the first product overwrites b (beta 0 ignores its contents)
            b.addmm_(d.T if conv1d else d, system.diffs[i], beta=1.0 if j else 0.0, alpha=c[i])  # type: ignore[arg-type]
    if system.factor is None:
        return torch.linalg.lstsq(system.summed.double(), b.T.double().contiguous()).solution.to(dtype).T
    # X^T = B^T S^-1 = (B^T L^-T) L^-1: two triangular solves from the right
    y = torch.linalg.solve_triangular(system.factor.mT, b, upper=True, left=False)
    return torch.linalg.solve_triangular(system.factor, y, upper=False, left=False)


def _finish(
    mean: torch.Tensor, x: torch.Tensor | None, out_dtype: torch.dtype, finite: list[bool] | None
) -> torch.Tensor:
    """``mean + x`` in ``out_dtype``, chunk by chunk, with the output's sum taken while each chunk is in cache.

    Single-threaded chunks: an all-core torch op spins into the next BLAS call. ``x`` (out, in) is row-major like
    the mean, so its flat view lines up with the mean's.
    """
    out = mean if mean.dtype == out_dtype else torch.empty(mean.shape, dtype=out_dtype)
    flat_m, flat_o = mean.view(-1), out.view(-1)
    flat_x = x.reshape(-1) if x is not None else None
    sums: list[torch.Tensor] = []
    acc = torch.float64 if out_dtype == torch.float64 else torch.float32  # 6x faster than float64 sums here

    def one(s: int, e: int) -> None:
        m = flat_m[s:e]
        if flat_x is not None:
            m.add_(flat_x[s:e])
        o = m if out is mean else flat_o[s:e].copy_(m)
        if finite is not None:
            sums.append(o.sum(dtype=acc))  # list.append is atomic

    if flat_x is not None or out is not mean or finite is not None:
        spans(one, mean.numel(), parallel=True)
    if finite is not None and math.isfinite(float(torch.stack(sums).double().sum()) if sums else 0.0):
        finite.append(True)
    return out


def _take(pool: BufferPool | None, slot: str, shape, dtype: torch.dtype) -> torch.Tensor:
    return pool.take(slot, shape, dtype) if pool is not None else torch.empty(shape, dtype=dtype)


def regmean_solve(
    weights: Sequence[torch.Tensor],
    grams: Sequence[torch.Tensor],
    model_weights: Sequence[float] | None = None,
    alpha: float = 0.9,
    conv1d: bool = False,
    dtype: torch.dtype = torch.float64,
    cache: GramSystem | None = None,
    delta_dtype: Literal["same", "bfloat16", "auto"] = "same",
    bf16_tol: float = 1e-6,
) -> tuple[torch.Tensor, GramSystem]:
    """Merge one linear layer's weights with RegMean (see the module docstring for the algebra).

    Args:
        weights: K weights, (out, in) (``nn.Linear``) or (in, out) (``conv1d``).
        grams: K input Grams (in, in) (not read when ``cache`` is given).
        model_weights: K non-negative weights of the models (default 1 each).
        alpha: Off-diagonal scale in [0, 1].
        conv1d: Weights are stored (in, out).
        dtype: Compute precision of the Gram sum, factor and solve.
        cache: The :class:`GramSystem` of the same Grams (another layer reading the same input), reused.
        delta_dtype: Precision of the correction products: ``same``, ``bfloat16`` or ``auto``.
        bf16_tol: ``auto``: largest predicted relative error accepted for bfloat16 products.

    Returns:
        ``(merged weight in the input layout and dtype, the GramSystem)``; ``system.factor`` is None after the
        lstsq fallback.

    Raises:
        ValueError: if alpha is outside [0, 1] or shapes disagree (the message names them).
    """
    system = cache if cache is not None else gram_system(grams, model_weights, alpha, dtype)
    out, _ = regmean_apply(system, weights, conv1d, delta_dtype, bf16_tol)
    return out, system


class RegMeanMerger(Merger):
    """RegMean for every linear weight with Grams; weighted mean for everything else."""

    name = "regmean"
    required_stats = frozenset({"gram"})
    propagates_nonfinite = True  # the weighted mean of all K weights is the output's first term
    Params = RegMeanParams

    def __init__(self, **params):
        super().__init__(**params)
        self._system: GramSystem | None = None
        self._system_key: str | None = None
        self._raw = BufferPool()  # the Grams as read (two buffers)
        self._finite: torch.Tensor | None = None  # the last output, when its final pass found it finite
        self._plain: tuple[str | None, PlainSystem] | None = None  # the device path's last system, by Gram key

    def close(self) -> None:
        """Release the Gram buffers."""
        self._system = None
        self._plain = None
        self._raw.clear()

    def merge_tensor(self, t: TensorInputs) -> torch.Tensor:
        """RegMean solve for a linear weight with Grams, weighted mean otherwise.

        Layers whose ``gram_key`` equals the previous layer's (one input, e.g. q / k / v) reuse its factor
        without reading their Grams. Each system is built in one fused pass over the K Grams
        (:func:`symfuse.merge.gram_systems.build_system`) in the calling thread, between the products and solves
        that use every core: a builder thread beside them made the products 1.4x slower on 2 cores.
        """
        self._finite = None
        if t.gram is None:
            return weighted_mean(t.tensors, t.weights)
        if self.device.type != "cpu":
            return self._merge_plain(t)
        p = self.params
        if t.gram_key is not None and t.gram_key == self._system_key and self._system is not None:
            system = self._system
            self.count("factor_reused")
        else:
            self._system = None
            dtype = getattr(torch, p.dtype)  # type: ignore[attr-defined]
            system = gram_systems.build_system(t.gram, t.weights, p.alpha, dtype, self.pool, self._raw)
            self._system, self._system_key = system, t.gram_key
            if system.factor is None:
                self.count("lstsq_fallback")
        finite: list[bool] = []
        out, used = regmean_apply(system, t.tensors, t.conv1d, p.delta_dtype, p.bf16_tol, finite=finite)  # type: ignore[attr-defined]
        self.count("regmean_solves")
        self.count(f"products_{used}")
        self._finite = out if finite else None
        return out

    def _merge_plain(self, t: TensorInputs) -> torch.Tensor:
        """The same merge in whole-tensor torch ops on ``self.device`` (:mod:`symfuse.merge.regmean_plain`)."""
        from symfuse.merge.regmean_plain import plain_apply, plain_system

        p = self.params
        cached = self._plain
        if t.gram_key is None or cached is None or cached[0] != t.gram_key:
            dtype = getattr(torch, p.dtype)  # type: ignore[attr-defined]
            self._plain = None  # the old system's memory is freed before the new one is built
            cached = self._plain = (t.gram_key, plain_system(t.gram, t.weights, p.alpha, dtype, self.device))  # type: ignore[arg-type,attr-defined]
            if cached[1].factor is None:
                self.count("lstsq_fallback")
        else:
            self.count("factor_reused")
        self.count("regmean_solves")
        return plain_apply(cached[1], [x.to(self.device) for x in t.tensors], t.conv1d)

    def output_finite(self, out: torch.Tensor) -> bool | None:
        """True when ``out`` is the last RegMean solve's output and its final pass found it finite, else None."""
        known, self._finite = self._finite is out, None
        return True if known else None
