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

from symfuse import native

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

    Works on contiguous row blocks of ``chunk`` elements in the stored layout (``down`` (d, n): blocks of its
    rows, gathered ``a[rows][:, cols]``), so float32 temporaries stay small for half-precision inputs.
    """
    n = cols.numel()
    total = torch.zeros(n, dtype=torch.float64)
    f32 = torch.float32
    for role, transposed, d in _dims(src):
        s, a = src[role], anc[role]
        if s.dim() == 1:
            total += (s.to(f32) - a[cols].to(f32)).square().double()
        elif transposed:  # (d, n): neurons are columns
            native.sqdist_columns(s, a, cols, total, chunk)
        else:
            step = max(1, chunk // d)
            for i in range(0, n, step):
                diff = s[i : i + step].to(f32) - a[cols[i : i + step]].to(f32)
                total[i : i + step] += diff.square().sum(1).double()
    return total


def _rows(w: Mapping[str, torch.Tensor], lo: int, hi: int) -> dict[str, torch.Tensor]:
    """Neurons ``lo:hi`` of FFN weights (rows of up / gate / biases, columns of down), as views."""
    return {role: (w[role][:, lo:hi] if transposed else w[role][lo:hi]) for role, transposed, _ in _dims(w)}


def _neurons(t: torch.Tensor, transposed: bool, idx: torch.Tensor | slice) -> torch.Tensor:
    """Feature rows (m, d) of the neurons ``idx`` of one role (``down`` holds neurons as columns)."""
    if transposed:
        return t[:, idx].T
    return t[idx][:, None] if t.dim() == 1 else t[idx]


def _exact_rows(
    src: Mapping[str, torch.Tensor], anc: Mapping[str, torch.Tensor], rows: torch.Tensor, chunk: int = 1 << 21
) -> torch.Tensor:
    """Exact nearest anchor neuron of the given source rows (float64, anchor neurons in blocks of ``chunk``)."""
    dims = _dims(src)
    n = _neurons(anc[dims[0][0]], dims[0][1], slice(None)).shape[0]
    step = max(1, chunk // sum(d for _, _, d in dims))
    f64 = torch.float64
    s_rows = [_neurons(src[role], tr, rows).to(f64) for role, tr, _ in dims]
    s_norm = sum((s * s).sum(1) for s in s_rows)
    best_val = torch.full((rows.numel(),), float("inf"), dtype=f64)
    best_idx = torch.zeros(rows.numel(), dtype=torch.long)
    for j in range(0, n, step):
        m = min(step, n - j)
        dist = s_norm[:, None].expand(-1, m).clone()  # (rows, m) ||s - a||² over all roles
        for s, (role, tr, _) in zip(s_rows, dims, strict=True):
            a = _neurons(anc[role], tr, slice(j, j + m)).to(f64)
            dist += (a * a).sum(1)[None, :] - 2 * s @ a.T
        val, idx = dist.min(1)
        better = val < best_val  # strict: the first minimum wins, as with one argmin over all neurons
        best_val = torch.where(better, val, best_val)
        best_idx = torch.where(better, idx + j, best_idx)
    return best_idx


def certified_nearest(
    src: Mapping[str, torch.Tensor],
    anc: Mapping[str, torch.Tensor],
    k: int = 64,
    seed: int = 0,
    chunk: int = 256,
    max_exact_rows: float = 0.05,
    probe: int = 256,
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
        probe: Rows tried first: when more than ``max_exact_rows`` of them fail the certificate, give up before
            sketching the rest.

    Returns:
        ``nn`` (n,) int64 with ``nn[i]`` = exact nearest anchor neuron of source neuron ``i``, or None.
    """
    dims = _dims(src)
    # coordinates from ``down`` (stored (d, n): a coordinate is a contiguous row) when it has enough: 3x cheaper
    # to gather than columns of ``up`` (a strided read of the whole matrix); any subset keeps the bound exact
    lo = sum(d for role, _, d in dims if role != "down")
    total = lo + dict((role, d) for role, _, d in dims)["down"]
    if total - lo < k:
        lo = 0
    k = min(k, total - lo)
    g = torch.Generator().manual_seed(seed)
    coords = torch.sort(lo + torch.randperm(total - lo, generator=g)[:k]).values
    ps, pa = _project(src, coords), _project(anc, coords)  # (n, k)
    n = ps.shape[0]
    na, ns = (pa * pa).sum(1), (ps * ps).sum(1)
    best = torch.empty(n, dtype=torch.long)
    second = torch.empty(n, dtype=torch.float32)
    pat = pa.T.contiguous()
    slack = 1e-4 * (ns + na.max()).double()

    def nearest(lo: int, hi: int) -> None:
        for i in range(lo, hi, chunk):
            j = min(i + chunk, hi)
            # (rows, n) |a_j|² - 2 <s_i, a_j>: the sketch dist² less the row constant |s_i|² (same row order)
            d2 = torch.addmm(na[None, :], ps[i:j], pat, alpha=-2)
            best[i:j], second[i:j] = native.row_two_smallest(d2)
            second[i:j] += ns[i:j]

    def certified(lo: int, hi: int) -> torch.Tensor:
        exact = _row_sqdist(_rows(src, lo, hi), anc, best[lo:hi])
        # float32 sketch distances carry ~1e-6 relative round-off of |ps|² + |pa|²: keep a margin above it
        return second[lo:hi].double() - slack[lo:hi] > exact * (1 + 1e-4)

    # probe: unrelated models fail the certificate on most rows; find out on a few before the full sketch
    p = min(n, probe)
    nearest(0, p)
    ok_probe = certified(0, p)
    if (~ok_probe).sum() > max_exact_rows * p:
        return None
    nearest(p, n)
    if torch.bincount(best, minlength=n).max() > 1:
        return None
    ok = torch.cat([ok_probe, certified(p, n)]) if p < n else ok_probe
    bad = (~ok).nonzero().flatten()
    if bad.numel() > max_exact_rows * n:
        return None
    if bad.numel():
        best[bad] = _exact_rows(src, anc, bad)
    return best
