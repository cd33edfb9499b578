"""The invertible map per head group closest to the anchor: ``min_M ||M A − A*||² + ||M^{-T} B − B*||²``.

``A`` (dh, na) is one KV group's side mapped by ``M`` (queries / values: their rows, biases and position rows over the
group's query heads), ``B`` (dh, nb) the side mapped by ``M^{-T}`` (keys / the rows of ``o^T``), ``A*``, ``B*`` the
anchor's. Only dh x dh products enter (:class:`CircuitGrams`); everything is batched over groups, float64, on the
Grams' device.

The problem is not convex (``M^{-T}``): the method finds a local minimum from good starting points.

1. Starting points, per group: the given one (the joint rotation + scale solution of the ``rotation`` and
   ``scaling`` kinds), and two linear least-squares solutions of the relaxed problems
   ``||M A − A*||² + ||M^T B* − B||²`` and ``||M^{-1} A* − A||² + ||M^{-T} B − B*||²`` with ``M^{-1}`` as the
   unknown, each a Sylvester equation ``X P + S X = C`` (``P``, ``S`` symmetric) solved by two symmetric
   eigendecompositions. When the source is an exact image of the anchor (``A = M0^{-1} A*``, ``B = M0^T B*``) both
   are exactly ``M0``, the global minimum (zero). The best of the three (finite, condition number at most
   ``max_cond``) is kept.
2. Gauss-Newton steps on ``M`` itself: linearising ``M^{-T}`` at ``M`` gives the normal equations
   ``E Gaa + Gn E K = −∇f/2`` (``N = M^{-T}``, ``Gn = N Gbb N^T``, ``K = N^T N``), brought to a Sylvester equation
   by the Cholesky factor of ``K``; each step is backtracked (halved) until it lowers ``f`` and keeps
   ``cond(M) <= max_cond``, otherwise the group stops. At most ``max_iter`` steps, stopping when ``f`` no longer
   drops by ``rtol`` of the blocks' squared norms.

Every accepted step lowers ``f``, so the result is never worse than the starting point given (the rotation + scale
solution). Cost per group and step: a few dh x dh inverses, one Cholesky, two eigendecompositions (O(dh³)).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from symfuse.runtime import torch_threads

log = logging.getLogger(__name__)

MAX_COND = 1e4  # the fitted maps stay this well conditioned (rounding of the transformed weights grows with it)


@dataclass(frozen=True)
class CircuitGrams:
    """The dh x dh products one group's fit needs (batched: leading axis n_kv), float64.

    Attributes:
        gaa: ``A A^T`` (source, mapped by ``M``).
        gbb: ``B B^T`` (source, mapped by ``M^{-T}``).
        ca: ``A* A^T``.
        cb: ``B* B^T``.
        haa: ``A* A*^T`` (anchor).
        hbb: ``B* B*^T`` (anchor).
    """

    gaa: torch.Tensor
    gbb: torch.Tensor
    ca: torch.Tensor
    cb: torch.Tensor
    haa: torch.Tensor
    hbb: torch.Tensor

    def scale(self) -> torch.Tensor:
        """``|A|² + |B|² + |A*|² + |B*|²`` per group (the yardstick of the stopping rule)."""
        return sum(_trace(g) for g in (self.gaa, self.gbb, self.haa, self.hbb))  # type: ignore[return-value]


def _trace(x: torch.Tensor) -> torch.Tensor:
    return torch.diagonal(x, dim1=-2, dim2=-1).sum(-1)


def objective(m: torch.Tensor, g: CircuitGrams) -> torch.Tensor:
    """``||M A − A*||² + ||M^{-T} B − B*||²`` per group (n,), from the Grams (inf where ``M`` is singular)."""
    n, ok = _inv_t(m)
    f = (
        _trace(m @ g.gaa @ m.mT)
        - 2 * (m * g.ca).sum((-2, -1))
        + _trace(n @ g.gbb @ n.mT)
        - 2 * (n * g.cb).sum((-2, -1))
        + _trace(g.haa)
        + _trace(g.hbb)
    )
    return torch.where(ok & torch.isfinite(f), f, torch.inf)


def _inv_t(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``M^{-T}`` and whether it exists (finite, invertible) per group."""
    inv, info = torch.linalg.inv_ex(m)
    ok = (info == 0) & torch.isfinite(inv).all(-1).all(-1)
    return torch.where(ok[:, None, None], inv, torch.zeros_like(inv)).mT, ok


def condition(m: torch.Tensor) -> torch.Tensor:
    """Condition number per group (inf where singular)."""
    s = torch.linalg.svdvals(m)
    return torch.where(s[..., -1] > 0, s[..., 0] / s[..., -1].clamp_min(1e-300), torch.inf)


def sylvester(p: torch.Tensor, s: torch.Tensor, c: torch.Tensor, rel_floor: float = 1e-12) -> torch.Tensor:
    """``X`` solving ``X P + S X = C`` for symmetric positive semi-definite ``P``, ``S`` (batched).

    In the eigenbases ``P = Up Lp Up^T``, ``S = Us Ls Us^T`` the equation is diagonal:
    ``X = Us [(Us^T C Up)_ij / (ls_i + lp_j)] Up^T``. Denominators are floored at ``rel_floor`` times the largest
    (a minimum-norm answer on a rank-deficient pair).
    """
    lp, up = torch.linalg.eigh(p)
    ls, us = torch.linalg.eigh(s)
    den = ls[..., :, None] + lp[..., None, :]
    floor = rel_floor * den.amax((-2, -1), keepdim=True).clamp_min(1e-300)
    return us @ ((us.mT @ c @ up) / den.clamp_min(floor)) @ up.mT


def _starts(m0: torch.Tensor, g: CircuitGrams, max_cond: float) -> torch.Tensor:
    """The best of ``m0`` and the two relaxed least-squares solutions, per group (see the module docstring)."""
    m1 = sylvester(g.gaa, g.hbb, g.ca + g.cb)  # M Gaa + Hbb M = Ca + Cb
    q = sylvester(g.haa, g.gbb, (g.ca + g.cb).mT)  # Q Haa + Gbb Q = Ca^T + Cb^T, M = Q^{-1}
    m2 = _inv_t(q)[0].mT
    best, f_best = m0, objective(m0, g)
    for m in (m1, m2):
        f = objective(m, g)
        take = (f < f_best) & (condition(m) <= max_cond)
        best = torch.where(take[:, None, None], m, best)
        f_best = torch.where(take, f, f_best)
    return best


def half_gradient(m: torch.Tensor, g: CircuitGrams) -> torch.Tensor:
    """``∇f / 2 = (M Gaa − Ca) − (Gn N − N Cb^T N)`` with ``N = M^{-T}``, ``Gn = N Gbb N^T`` (batched)."""
    n, _ = _inv_t(m)
    return (m @ g.gaa - g.ca) - (n @ g.gbb @ n.mT @ n - n @ g.cb.mT @ n)


def _gauss_newton_step(m: torch.Tensor, g: CircuitGrams) -> torch.Tensor:
    """The Gauss-Newton step ``E`` at ``M``: ``E Gaa + Gn E K = −(∇f)/2`` (see the module docstring)."""
    n, _ = _inv_t(m)
    gn, k = n @ g.gbb @ n.mT, n.mT @ n
    grad = half_gradient(m, g)
    chol = torch.linalg.cholesky(k)  # K = L L^T; E = F L^{-1} turns the equation into F H + Gn F = −grad L^{-T}
    eye = torch.eye(m.shape[-1], dtype=m.dtype, device=m.device).expand_as(m)
    l_inv = torch.linalg.solve_triangular(chol, eye, upper=False)
    h = l_inv @ g.gaa @ l_inv.mT
    f = sylvester(h, gn, -grad @ l_inv.mT)
    return f @ l_inv


def closest_linear(
    m0: torch.Tensor,
    grams: CircuitGrams,
    max_iter: int = 50,
    rtol: float = 1e-14,
    max_cond: float = MAX_COND,
    halvings: int = 20,
) -> torch.Tensor:
    """Invertible ``M`` per group minimising ``||M A − A*||² + ||M^{-T} B − B*||²``, never worse than ``m0``.

    Args:
        m0: (n, dh, dh) starting maps (the rotation + scale solution), invertible.
        grams: The groups' products (same batch, float64).
        max_iter: Gauss-Newton steps at most.
        rtol: A group stops when a step lowers ``f`` by less than ``rtol`` times its blocks' squared norms.
        max_cond: Starts and steps with a larger condition number are refused.
        halvings: Backtracking halvings of a step at most.

    Returns:
        (n, dh, dh) float64, on ``m0``'s device.
    """
    f64 = torch.float64
    m0 = m0.to(f64)
    g = CircuitGrams(*(t.to(f64) for t in (grams.gaa, grams.gbb, grams.ca, grams.cb, grams.haa, grams.hbb)))
    with torch_threads(1):  # a batch of small problems: one thread each call is fastest
        m = _starts(m0, g, max_cond)
        f = objective(m, g)
        tol = rtol * g.scale()
        active = torch.isfinite(f)
        it = 0
        while bool(active.any()) and it < max_iter:
            it += 1
            step = _gauss_newton_step(m, g)
            step = torch.where(torch.isfinite(step), step, torch.zeros_like(step))
            accepted, gain, t = ~active, torch.zeros_like(f), 1.0  # stopped groups do not move
            for _ in range(halvings):  # backtracking: the first t = 1, 1/2, ... that lowers f
                trial = m + t * step
                ft = objective(trial, g)
                good = ~accepted & (ft < f) & (condition(trial) <= max_cond)
                gain = torch.where(good, f - ft, gain)
                m, f = torch.where(good[:, None, None], trial, m), torch.where(good, ft, f)
                accepted = accepted | good
                if bool(accepted.all()):
                    break
                t /= 2
            active = active & accepted & (gain > tol)
        log.debug("closest invertible maps: %d Gauss-Newton steps", it)
    return m
