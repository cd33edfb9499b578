"""``symfuse match`` in one pass: each module is read, matched, transformed, checked and written by one worker.

The output shards are laid out before matching starts (same tensors, shapes, dtypes and shard split as
:func:`symfuse.checkpoint.write_checkpoint` gives, so the bytes are the same): every module's new tensors are
written at their offsets (:class:`symfuse.io.planned.PlannedFile`) as soon as that module is done, and the tensors
outside the modules (embeddings, norms, heads) are copied in row blocks alongside. Nothing waits in memory for a
shard to fill, the anchor is read once, and distances are taken on tensors already in memory. Everything goes
into the caller's temporary folder, published only when the whole command succeeded.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from symfuse.arch import ModuleRef
from symfuse.checkpoint import CheckpointReader, copy_side_files
from symfuse.device import resolve_device
from symfuse.errors import CheckpointError
from symfuse.io import rows_per_block
from symfuse.io.planned import PlannedCheckpoint
from symfuse.match.closed_form import torch_threads
from symfuse.match.inputs import check_shapes, read_checked, strip_prefix
from symfuse.match.reading import PreadSource
from symfuse.match.verify import check_module_transform, is_exact, module_invariants
from symfuse.match.weights import match_module_weights
from symfuse.runtime import module_workers
from symfuse.symmetry.transforms import ModuleTransform

ROW_BLOCK = 1 << 20  # elements per block when copying tensors outside the modules (4 MiB of float32: the copy
# holds a block of the source, one of the anchor and their difference while the other worker matches)


def fast_sq_distance(a: torch.Tensor, b: torch.Tensor, block: int = 1024) -> float:
    """``||a - b||²`` in one pass, no float64 copies (relative error ~1e-8).

    The difference in (at least) float32, norms of blocks of ``block`` elements in float32, their squares summed
    in float64.
    """
    dtype = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
    d = torch.sub(a.to(dtype), b.to(dtype)).reshape(-1)
    n = d.numel() - d.numel() % block
    total = 0.0
    if n:
        total += float(torch.linalg.vector_norm(d[:n].view(-1, block), dim=1).double().square().sum())
    if n < d.numel():
        total += float(d[n:].double().square().sum())
    return total


def module_sq_distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Squared Frobenius distance over the roles both share (see :func:`fast_sq_distance`)."""
    return sum(fast_sq_distance(a[r], b[r]) for r in sorted(a.keys() & b.keys()))


def _copy_rest(
    names: Sequence[str],
    src: PreadSource,
    anc: PreadSource | None,
    anc_names: dict[str, str],
    out: PlannedCheckpoint,
    sq: dict[str, float],
) -> None:
    """Copy the tensors outside the modules in row blocks: finiteness checked, distance to the anchor taken."""
    for name in names:
        dtype, shape = src.meta(name)
        other = anc_names.get(name)
        if other is not None and anc is not None:
            a_dtype, a_shape = anc.meta(other)
            if a_shape != shape or not a_dtype.is_floating_point or not dtype.is_floating_point:
                other = None
        if not shape:
            t = src.get(name)
            _check_finite(t, src, name)
            sq[name] = fast_sq_distance(t, anc.get(other)) if other is not None and anc is not None else 0.0
            out.write(name, t)
            continue
        row = rows_per_block(shape, ROW_BLOCK)
        total = 0.0
        for lo in range(0, shape[0], row):
            hi = min(shape[0], lo + row)
            t = src.get_rows(name, lo, hi)
            _check_finite(t, src, name)
            if other is not None and anc is not None:
                total += fast_sq_distance(t, anc.get_rows(other, lo, hi))
            out.write(name, t, lo)
        if shape[0] == 0:
            out.write(name, src.get(name))
        sq[name] = total


def _check_finite(t: torch.Tensor, src: PreadSource, name: str) -> None:
    if t.is_floating_point() and not torch.isfinite(t.sum()) and not torch.isfinite(t).all():
        raise CheckpointError(
            f"{src.reader.path}: tensor {name} holds NaN or inf values; fix or re-export the checkpoint"
        )


class _Stopwatch:
    """Seconds per stage, summed over threads into ``timings``."""

    def __init__(self, timings: dict[str, float]):
        self.timings, self._lock = timings, threading.Lock()

    def tick(self, key: str, t0: float) -> float:
        """Add ``now - t0`` to ``key``; returns now (the next stage's start)."""
        now = time.perf_counter()
        with self._lock:
            self.timings[key] = self.timings.get(key, 0.0) + now - t0
        return now


@dataclass
class _ModuleJob:
    """What matching one module needs: both checkpoints, the output plan, where to compute, and the results."""

    src: CheckpointReader
    src_io: PreadSource
    anc_io: PreadSource
    plan: PlannedCheckpoint
    symmetries: Sequence[str]
    dev: torch.device
    where: str
    clock: _Stopwatch
    owner: dict[str, ModuleRef]
    results: dict[str, tuple[ModuleTransform, float, float]] = field(default_factory=dict)

    def _on_dev(self, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return w if self.dev.type == "cpu" else {r: t.to(self.dev) for r, t in w.items()}

    def __call__(self, ref: ModuleRef) -> None:
        """Read, match, transform, check and write module ``ref``; record its transform and distances."""
        src, tick = self.src, self.clock.tick
        t0 = time.perf_counter()
        s, a = read_checked(self.src_io, ref), read_checked(self.anc_io, ref)
        t0 = tick("io", t0)
        check_shapes(ref, s, a, f"{src.path} vs {self.anc_io.reader.path}")
        s, a = self._on_dev(s), self._on_dev(a)
        mt = match_module_weights(ref, s, a, src.geometry, self.symmetries, self.clock.timings)
        t0 = time.perf_counter()
        before = module_sq_distance(s, a)
        del a  # at most two copies of the module per worker, as while matching: the anchor is read again below
        t0 = tick("distance", t0)
        # a soft (OT) map changes the module's function by design; otherwise the invariants are taken now, so
        # the source module is freed before the transformed one is checked (one module copy while checking)
        before_inv = module_invariants(ref, s, src.geometry) if is_exact(mt) else None
        t0 = tick("check", t0)
        new = mt.apply(s)
        del s
        t0 = tick("apply", t0)
        if before_inv is not None:
            check_module_transform(ref, before_inv, new, src.geometry, mt, self.where)
        t0 = tick("check", t0)
        after = module_sq_distance(new, self._on_dev(self.anc_io.read_module(ref)))  # from the page cache
        t0 = tick("distance", t0)
        new = {r: t.cpu() for r, t in new.items()}
        for name, t in src.spec.write_module(new, ref, src.config, src.prefix).items():
            if name in self.owner:
                if tuple(t.shape) != tuple(src.shape(name)):
                    raise CheckpointError(f"{name}: replacement shape {tuple(t.shape)} != {src.shape(name)}")
                self.plan.write(name, t)
        del new
        tick("write", t0)
        self.results[ref.key] = (mt.to("cpu"), before, after)


def _run_all(jobs: Sequence[Callable[[], None]], workers: int) -> None:
    """Run ``jobs`` in order (one worker) or on ``workers`` threads; the first failure stops the rest, and is raised."""
    if workers <= 1:
        for job in jobs:
            job()
        return
    with ThreadPoolExecutor(workers) as pool:
        futures = [pool.submit(job) for job in jobs]
        try:
            for f in as_completed(futures):
                f.result()
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)  # a failed module stops the rest
            raise


def _totals(
    src: CheckpointReader, owner: dict[str, ModuleRef], results: dict, rest_sq: dict[str, float]
) -> tuple[float, float]:
    """Squared distances before and after over the whole checkpoint, summed in storage order."""
    before = after = 0.0
    seen: set[str] = set()
    for name in src.names():  # storage order, as the streaming writer summed them
        ref = owner.get(name)
        if ref is None:
            before += rest_sq[name]
            after += rest_sq[name]
        elif ref.key not in seen:
            seen.add(ref.key)
            before += results[ref.key][1]
            after += results[ref.key][2]
    return before, after


def match_and_write(
    src: CheckpointReader,
    anc: CheckpointReader,
    out: Path,
    symmetries: Sequence[str],
    workers: int | None = None,
    timings: dict[str, float] | None = None,
    shard_bytes: int = 128 * 1024**2,
    where: str | None = None,
    device: torch.device | str = "cpu",
) -> tuple[dict[str, ModuleTransform], list[dict[str, Any]], float, float]:
    """Match every module of ``src`` onto ``anc`` and write the matched weights into ``out`` (a temp folder).

    Args:
        src: Source checkpoint (open).
        anc: Anchor checkpoint (open; same family and shapes).
        out: Existing empty folder (the caller publishes it).
        symmetries: Symmetry kinds to match.
        workers: Threads (None: :func:`symfuse.runtime.module_workers`: 2 to 8 by CPUs, 1 for 7B widths).
        timings: Accumulates seconds per stage (summed over threads).
        shard_bytes: Largest output shard.
        where: The output's final name, for errors (default ``out``).
        device: Where each module's matching, transform and check run (one module on it at a time per worker);
            the assignment solver and the small per-head fits run on the CPU, the weights are written from host
            memory, and the returned transforms are on the CPU.

    Returns:
        ``(transforms by module key, per-module distance records, distance before, distance after)``.

    Raises:
        CheckpointError: shapes differ, NaN / inf in an input.
        VerificationError: a transform did not keep its module's function (the module is named).
    """
    refs = src.modules()
    if workers is None:
        workers = module_workers(src.geometry.d_model, src.geometry.d_ffn)
    clock = _Stopwatch(timings if timings is not None else {})
    owner = src.tensor_owners()
    rest = [n for n in src.names() if n not in owner]
    anc_names = {strip_prefix(n, anc.prefix): n for n in anc.names()}
    anc_of = {n: anc_names[strip_prefix(n, src.prefix)] for n in rest if strip_prefix(n, src.prefix) in anc_names}
    plan = PlannedCheckpoint(src, out, shard_bytes)
    src_io, anc_io = PreadSource(src), PreadSource(anc)
    rest_sq: dict[str, float] = {}
    match_one = _ModuleJob(
        src, src_io, anc_io, plan, symmetries, resolve_device(device), where or str(out), clock, owner
    )

    def copy_rest() -> None:
        t0 = time.perf_counter()
        _copy_rest(rest, src_io, anc_io, anc_of, plan, rest_sq)
        clock.tick("rest", t0)

    def module_job(ref: ModuleRef) -> None:
        if workers > 1:  # one torch thread each (no oversubscription)
            with torch_threads(1):
                return match_one(ref)
        match_one(ref)

    jobs = [functools.partial(module_job, r) for r in sorted(refs, key=lambda r: r.kind != "ffn")] + [copy_rest]
    try:
        with src_io, anc_io:
            _run_all(jobs, workers)
            t0 = time.perf_counter()
            plan.finish()
            copy_side_files(src, out)
            clock.tick("write", t0)
    finally:
        plan.close()
    results = match_one.results
    per_module = [
        {"module": r.key, "kind": r.kind, "distance_before": results[r.key][1] ** 0.5,
         "distance_after": results[r.key][2] ** 0.5}
        for r in sorted(refs)
    ]  # fmt: skip
    before, after = _totals(src, owner, results, rest_sq)
    return {r.key: results[r.key][0] for r in refs}, per_module, before**0.5, after**0.5
