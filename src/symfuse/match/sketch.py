"""Certified nearest neighbours of FFN neurons from a random sketch (exact, no full cost matrix).

Neuron features ``f_i = [up_i | b_i | gate_i | down[:, i]]`` (length ``D``). The sketch keeps ``k`` random
coordinates of the features (an orthonormal projection that costs only a gather), so sketch distances are LOWER
bounds of true distances (a sum over a subset of the squared coordinate differences). If row ``i``'s
sketch nearest anchor ``c(i)`` satisfies ``true_dist(i, c(i)) < second smallest sketch distance of row i``, then
``c(i)`` is row ``i``'s exact nearest neighbour, i.e. the exact argmax of row ``i`` of the Hungarian similarity
``<s_i, a_j> - ½|s_i|² - ½|a_j|²`` (see :func:`symfuse.match.weights.ffn_similarity`). Rows that fail the test get
their exact row computed. When the certified argmaxes form a permutation it is the assignment optimum (each row at
its maximum); otherwise the caller falls back to the full cost matrix and Hungarian. Costs ``O(n D k + n² k)``
instead of ``O(n² D)``: the planted case (two fine-tunes of one base) never builds the n x n float matrix in full.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

_ROLES = (("up", False), ("up_bias", False), ("gate", False), ("gate_bias", False), ("down", True))


def _dims(w: Mapping[str, torch.Tensor]) -> list[tuple[str, bool, int]]:
    out = []
    for role, transposed in _ROLES:
        if role in w:
            t = w[role]
            out.append((role, transposed, 1 if t.dim() == 1 else (t.shape[0] if transposed else t.shape[1])))
    return out


def _project(w: Mapping[str, torch.Tensor], coords: torch.Tensor) -> torch.Tensor:
    """The features' coordinates ``coords`` (sorted) as (n, k) float32, gathered role by role."""
    parts, off = [], 0
    for role, transposed, d in _dims(w):
        sel = coords[(coords >= off) & (coords < off + d)] - off
        off += d
        if sel.numel() == 0:
            continue
        t = w[role]
        if t.dim() == 1:
            parts.append(t[:, None].to(torch.float32))
        elif transposed:
            parts.append(t[sel].T.to(torch.float32))
        else:
            parts.append(t[:, sel].to(torch.float32))
    return torch.cat(parts, dim=1)


def _row_sqdist(
    src: Mapping[str, torch.Tensor], anc: Mapping[str, torch.Tensor], cols: torch.Tensor, chunk: int = 1 << 21
) -> torch.Tensor:
    """``||s_i - a_cols[i]||²`` for every source row i (float32 differences, float64 accumulation).

    Transposed roles (``down``) are gathered along their stored rows (``a[:, cols]``, contiguous reads) and the
    work runs in neuron chunks of ``chunk`` elements, so float32 temporaries stay small for half-precision inputs.
    """
    n = cols.numel()
    total = torch.zeros(n, dtype=torch.float64)
    f32 = torch.float32
    for role, transposed, d in _dims(src):
        s, a = src[role], anc[role]
        step = max(1, chunk // d)
        for i in range(0, n, step):
            c = cols[i : i + step]
            if s.dim() == 1:
                diff = s[i : i + step].to(f32) - a[c].to(f32)
                total[i : i + step] += (diff * diff).double()
            elif transposed:  # (d, n): neurons are columns
                diff = s[:, i : i + step].to(f32) - a[:, c].to(f32)
                total[i : i + step] += diff.square().sum(0).double()
            else:
                diff = s[i : i + step].to(f32) - a[c].to(f32)
                total[i : i + step] += diff.square().sum(1).double()
    return total


def _exact_rows(src: Mapping[str, torch.Tensor], anc: Mapping[str, torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
    """Exact nearest anchor neuron of the given source rows."""
    dist = None
    for role, transposed, _ in _dims(src):
        s, a = src[role], anc[role]
        if transposed:
            s, a = s.T, a.T
        s = s[rows].to(torch.float64).reshape(rows.numel(), -1)
        a = a.to(torch.float64).reshape(a.shape[0], -1)
        part = (s * s).sum(1)[:, None] + (a * a).sum(1)[None, :] - 2 * s @ a.T
        dist = part if dist is None else dist + part
    return dist.argmin(1)


def certified_nearest(
    src: Mapping[str, torch.Tensor],
    anc: Mapping[str, torch.Tensor],
    k: int = 64,
    seed: int = 0,
    chunk: int = 2048,
    max_exact_rows: float = 0.05,
) -> torch.Tensor | None:
    """Exact nearest anchor neuron for every source neuron, or None when the sketch cannot certify cheaply.

    Args:
        src: Source FFN canonical weights (up, down, optional gate and biases).
        anc: Anchor FFN canonical weights.
        k: Sketch size.
        seed: Seed of the random orthonormal sketch.
        chunk: Source rows per block of sketch distances (bounds memory at ``chunk x n``).
        max_exact_rows: Give up (None) when more than this fraction of rows fails the certificate or when the
            sketch's nearest neighbours are not a permutation (then the full problem is needed anyway).

    Returns:
        ``nn`` (n,) int64 with ``nn[i]`` = exact nearest anchor neuron of source neuron ``i``, or None.
    """
    dims = _dims(src)
    total = sum(d for _, _, d in dims)
    k = min(k, total)
    g = torch.Generator().manual_seed(seed)
    coords = torch.sort(torch.randperm(total, generator=g)[:k]).values
    ps, pa = _project(src, coords), _project(anc, coords)  # (n, k)
    n = ps.shape[0]
    na, ns = (pa * pa).sum(1), (ps * ps).sum(1)
    best = torch.empty(n, dtype=torch.long)
    second = torch.empty(n, dtype=torch.float32)
    pat = pa.T.contiguous()
    for i in range(0, n, chunk):
        # (chunk, n) |a_j|² - 2 <s_i, a_j>: the sketch dist² less the row constant |s_i|² (same row order)
        d2 = torch.addmm(na[None, :], ps[i : i + chunk], pat, alpha=-2)
        vals, idx = torch.topk(d2, 2, dim=1, largest=False)
        best[i : i + chunk], second[i : i + chunk] = idx[:, 0], vals[:, 1] + ns[i : i + chunk]
    if torch.bincount(best, minlength=n).max() > 1:
        return None
    exact = _row_sqdist(src, anc, best)
    # float32 sketch distances carry ~1e-6 relative round-off of |ps|² + |pa|²: keep a margin above it
    slack = 1e-4 * (ns + na.max()).double()
    ok = second.double() - slack > exact * (1 + 1e-4)
    bad = (~ok).nonzero().flatten()
    if bad.numel() > max_exact_rows * n:
        return None
    if bad.numel():
        best[bad] = _exact_rows(src, anc, bad)
    return best
