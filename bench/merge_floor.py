"""The floors bench/merge_speed.py measures RegMean against (``--job floor``, ``--job iofloor``).

:func:`arithmetic_floor`: the timed primitives of the exact delta form at roberta-base's shapes, the faster of
torch's and scipy's implementation each. :func:`io_floor`: moving the merge's bytes once (read what it reads, write
what it writes), no arithmetic.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path


def roberta_config():
    """The roberta-base shape both benches use (2-label head)."""
    import transformers as T

    return T.RobertaConfig(
        vocab_size=50265,
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        intermediate_size=3072,
        max_position_embeddings=514,
        type_vocab_size=1,
        pad_token_id=1,
        num_labels=2,
    )


def arithmetic_floor(k: int) -> dict:
    """Lower bounds on RegMean's time for K models of this shape on this CPU (float32, no I/O, no overhead).

    The delta form needs, per linear layer (n inputs, m outputs): K - 1 products (n, n) @ (n, m) and one
    Cholesky solve (2 n^2 m); per distinct input one Cholesky factorisation (n^3 / 3). Each primitive is timed
    here at the model's real shapes (best of 3, all cores), with torch's BLAS / LAPACK and with scipy's (the two
    ``linalg`` backends of the merge), and the faster is multiplied by its count: the compute floor of the
    algorithm at this machine's fastest BLAS speed. ``gemm_bound`` charges every flop at the measured GEMM rate (the
    fastest primitive): no exact method with classical matrix products can beat it.
    """
    import torch
    import transformers as T

    from symfuse.stats import linear_modules

    with torch.device("meta"):
        model = T.RobertaForSequenceClassification(roberta_config())
    lins = [(n, m.in_features, m.out_features) for n, m in linear_modules(model).items()]
    inputs = {(n.rsplit(".", 1)[0] if n.endswith(("query", "key", "value")) else n): i for n, i, _ in lins}

    def best(fn) -> float:
        return best_fresh(lambda: None, fn)

    def best_fresh(reset, fn) -> float:
        reset()
        fn()
        times = []
        for _ in range(3):
            reset()  # an in-place primitive gets its input back, untimed
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)

    from symfuse.merge import linalg
    from symfuse.merge.base import chunked

    linalg.sync_threads()
    cache: dict[tuple, float] = {}
    fastest: dict[str, set[str]] = {"gemm": set(), "chol": set(), "solve": set()}
    by_backend = {"torch": 0.0, "scipy": 0.0}  # the floor with one backend's primitives throughout
    both: dict[tuple, dict[str, float]] = {}

    def timed(kind: str, n: int, m: int = 0) -> float:
        """The fastest of torch's and scipy's implementation (the merge's ``linalg`` choices) of one primitive."""
        if (kind, n, m) not in cache:
            g = torch.randn(n, n, dtype=torch.float64)
            spd = (g @ g.T / n + torch.eye(n, dtype=torch.float64)).float()
            rhs = torch.randn(m, n)  # held transposed, as RegMean holds B^T
            work = spd.clone()
            factors = {b: linalg.cholesky_(spd.clone(), b) for b in ("torch", "scipy")}
            out = torch.empty(m, n)
            fns = {
                ("gemm", "torch"): lambda: torch.mm(rhs, spd, out=out),
                ("gemm", "scipy"): lambda: linalg.addmm_(out, rhs, spd, 0.0, 1.0, "scipy"),
                # the factorisation in place (as the merge does): each run on a fresh copy, the copy not timed
                ("chol", "torch"): lambda: torch.linalg.cholesky(spd),
                ("chol", "scipy"): lambda: linalg.cholesky_(work, "scipy"),
                ("solve", "torch"): lambda: torch.cholesky_solve(rhs.T, factors["torch"].data),
                ("solve", "scipy"): lambda: linalg.cholesky_solve_t_(out, factors["scipy"]),
            }
            times = {}
            # an in-place primitive's input is restored by single-threaded chunk copies: a torch copy_ on all
            # cores leaves torch's threads spinning into the timed call (a (3072, 3072) solve: 70 ms, not 62)
            for backend in ("torch", "scipy"):
                if kind == "chol" and backend == "scipy":
                    times[backend] = best_fresh(lambda: chunked(torch.Tensor.copy_, work, spd), fns[kind, backend])
                elif kind == "solve" and backend == "scipy":
                    times[backend] = best_fresh(lambda: chunked(torch.Tensor.copy_, out, rhs), fns[kind, backend])
                else:
                    times[backend] = best(fns[kind, backend])
            winner = min(times, key=times.__getitem__)
            fastest[kind].add(winner)
            cache[kind, n, m] = times[winner]
            both[kind, n, m] = times
        return cache[kind, n, m]

    def count(kind: str, n: int, m: int, times: int) -> float:
        seconds = timed(kind, n, m) * times
        for backend in by_backend:
            by_backend[backend] += both[kind, n, m][backend] * times
        return seconds

    flops = {"products": 0.0, "solves": 0.0, "cholesky": 0.0}
    seconds = dict.fromkeys(flops, 0.0)
    for _, n, m in lins:
        flops["products"] += (k - 1) * 2 * n * n * m
        seconds["products"] += count("gemm", n, m, k - 1)
        flops["solves"] += 2 * n * n * m
        seconds["solves"] += count("solve", n, m, 1)
    for n in inputs.values():
        flops["cholesky"] += n**3 / 3
        seconds["cholesky"] += count("chol", n, 0, 1)
    gemm_rate = 2 * 3072 * 3072 * 768 / timed("gemm", 3072, 768)
    total = sum(flops.values())
    return {"flops": flops, "seconds": seconds, "floor_s": sum(seconds.values()), "gemm_gflops": gemm_rate / 1e9,
            "gemm_bound_s": total / gemm_rate, "tflop": total / 1e12,
            "fastest": {k: sorted(v) for k, v in fastest.items()}, "by_backend": by_backend}  # fmt: skip


def _merge_reads(root: Path, k: int, suffix: str = ""):
    """``(TensorFile, name)`` of every tensor the merge reads: each model's tensors, and the Grams of its statistics
    (``s{i}{suffix}``) except those recorded as another key's ``same_input`` (k / v: q's Gram is read once)."""
    from symfuse.io import TensorFile

    for i in range(k):
        grams_file = root / f"s{i}{suffix}" / "gram.safetensors"
        for file, grams in ((grams_file, True), (root / f"m{i}" / "model.safetensors", False)):
            with TensorFile(file) as tf:
                alias = set(json.loads(tf.metadata.get("same_input", "{}"))) if grams else set()
                for name in tf.header.tensors:
                    if name not in alias:
                        yield tf, name


def _read_inputs(root: Path, k: int, pool, suffix: str = "") -> int:
    """Read every tensor the merge reads once into ``pool``; the bytes read."""
    nbytes = 0
    for tf, name in _merge_reads(root, k, suffix):
        nbytes += tf.get(name, pool, "x").numel() * tf.dtype(name).itemsize
    return nbytes


def io_floor(root: Path, k: int, suffix: str = "") -> dict:
    """Seconds to move the merge's bytes once (warm page cache): read what it reads, write what it writes.

    The read is the faster of two ways: ``preadv`` into reused buffers (below), and mapping the files and summing
    every byte once in the merge's single-threaded chunks (no copy: :func:`_touch_inputs`).

    Every Gram the merge reads (from ``s{i}{suffix}``, as stored: float64, or float32 for ``-f32``; k / v Grams
    that are recorded as q's ``same_input`` are not read) and every tensor of the K models, each read into one
    reused buffer with the library's own reader (``preadv``, split across threads); then the output's bytes
    written once and fsynced, the faster of buffered ``pwrite`` and ``O_DIRECT`` (the merge writes its large
    tensors directly: :mod:`symfuse.io.direct`). No conversion, no arithmetic: what any implementation reading
    these files and writing the result must pay.
    """
    import os

    from symfuse.io import BufferPool, TensorFile, parallel_reads

    pool = BufferPool()
    t = time.perf_counter()
    with parallel_reads():  # as the merge reads
        nbytes = _read_inputs(root, k, pool, suffix)
    read_s = time.perf_counter() - t
    t = time.perf_counter()
    mapped = _touch_inputs(root, k, suffix)
    mmap_s = time.perf_counter() - t
    with TensorFile(root / "m0" / "model.safetensors") as tf:
        out = sum(t.nbytes for t in tf.header.tensors.values())
    buffered_s = _write_floor(root, out, direct=False)
    direct_s = _write_floor(root, out, direct=True) if hasattr(os, "O_DIRECT") else math.inf
    return {"read_s": min(read_s, mmap_s), "preadv_s": read_s, "mmap_s": mmap_s, "read_gb": nbytes / 1e9,
            "mmap_gb": mapped / 1e9, "write_s": min(buffered_s, direct_s), "buffered_write_s": buffered_s,
            "direct_write_s": direct_s, "write_gb": out / 1e9}  # fmt: skip


def _write_floor(root: Path, nbytes: int, direct: bool) -> float:
    """Seconds to write ``nbytes`` to a new file under ``root`` and fsync it: buffered ``pwrite``, or ``O_DIRECT``
    from one page-aligned 64 MiB buffer (the file is cut to size after; inf where the file system refuses)."""
    import mmap
    import os
    import tempfile

    buf = mmap.mmap(-1, 1 << 26)  # page-aligned
    view = memoryview(buf)
    try:
        with tempfile.NamedTemporaryFile(dir=root, suffix=".io") as fh:
            fd = os.open(fh.name, os.O_WRONLY | os.O_DIRECT) if direct else fh.fileno()
            try:
                t = time.perf_counter()
                done = 0
                while done < nbytes:
                    n = min(len(buf), nbytes - done)
                    done += os.pwrite(fd, view[: -(-n // 4096) * 4096 if direct else n], done)
                if direct:
                    os.ftruncate(fd, nbytes)
                os.fsync(fd)
                return time.perf_counter() - t
            except OSError:
                return math.inf
            finally:
                if direct:
                    os.close(fd)
    finally:
        view.release()
        buf.close()


def _touch_inputs(root: Path, k: int, suffix: str = "") -> int:
    """Every byte :func:`_read_inputs` reads, mapped (no copy) and summed once by the merge's chunk threads."""
    import mmap
    import warnings

    import torch

    from symfuse.merge.base import chunked_sum

    nbytes, maps = 0, {}
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # page tables filled in one call
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a read-only buffer: only read here
            for tf, name in _merge_reads(root, k, suffix):
                if tf.path not in maps:  # one mapping per file, the previous file's dropped
                    for m in maps.values():
                        m.close()
                    with open(tf.path, "rb") as fh:
                        maps = {tf.path: mmap.mmap(fh.fileno(), 0, flags, mmap.PROT_READ)}
                info = tf.info(name)
                size = info.nbytes - info.nbytes % 4
                if size:
                    view = torch.frombuffer(maps[tf.path], dtype=torch.int32, count=size // 4, offset=info.begin)
                    chunked_sum(view)
                    del view
                    nbytes += info.nbytes
    finally:
        for m in maps.values():
            m.close()
    return nbytes
