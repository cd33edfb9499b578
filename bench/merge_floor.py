"""The floors bench/merge_speed.py measures RegMean against (``--job floor``, ``--job iofloor``).

:func:`arithmetic_floor`: the timed primitives of the exact delta form at roberta-base's shapes (torch's BLAS /
LAPACK). :func:`io_floor`: moving the merge's bytes once (read what it reads, write
what it writes), no arithmetic.
"""

from __future__ import annotations

import json
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
    here at the model's real shapes (best of 3, all cores) with torch's BLAS / LAPACK, as the merge calls it, and
    multiplied by its count: the compute floor of the algorithm on this machine. ``gemm_bound`` charges every flop
    at the measured GEMM rate (the fastest primitive): no exact method with classical matrix products can beat it.
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

    from symfuse.merge.base import chunked

    cache: dict[tuple, float] = {}

    def timed(kind: str, n: int, m: int = 0) -> float:
        """One primitive as the merge runs it (torch's BLAS / LAPACK)."""
        if (kind, n, m) not in cache:
            g = torch.randn(n, n, dtype=torch.float64)
            spd = (g @ g.T / n + torch.eye(n, dtype=torch.float64)).float()
            rhs = torch.randn(m, n)  # held transposed, as RegMean holds B^T
            work, info = spd.clone(), torch.empty((), dtype=torch.int32)
            factor = torch.linalg.cholesky(spd)
            out = torch.empty(m, n)
            if kind == "gemm":
                cache[kind, n, m] = best(lambda: out.addmm_(rhs, spd, beta=0.0))
            elif kind == "chol":  # in place, as the merge factors: each run on a fresh copy, the copy not timed
                # (restored by single-threaded chunk copies: a torch copy_ on all cores leaves torch's threads
                # spinning into the timed call)
                reset = lambda: chunked(torch.Tensor.copy_, work, spd)  # noqa: E731
                cache[kind, n, m] = best_fresh(reset, lambda: torch.linalg.cholesky_ex(work, out=(work, info)))
            else:
                cache[kind, n, m] = best(lambda: torch.cholesky_solve(rhs.T, factor))
        return cache[kind, n, m]

    def count(kind: str, n: int, m: int, times: int) -> float:
        return timed(kind, n, m) * times

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
            "gemm_bound_s": total / gemm_rate, "tflop": total / 1e12}  # fmt: skip


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
    written once with buffered ``pwrite`` and fsynced, as the merge writes. No conversion, no arithmetic: what any
    implementation reading these files and writing the result must pay.
    """
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
    return {"read_s": min(read_s, mmap_s), "preadv_s": read_s, "mmap_s": mmap_s, "read_gb": nbytes / 1e9,
            "mmap_gb": mapped / 1e9, "write_s": _write_floor(root, out), "write_gb": out / 1e9}  # fmt: skip


def _write_floor(root: Path, nbytes: int) -> float:
    """Seconds to write ``nbytes`` to a new file under ``root`` with buffered ``pwrite`` from one 64 MiB buffer
    and fsync it."""
    import os
    import tempfile

    view = memoryview(bytearray(1 << 26))
    with tempfile.NamedTemporaryFile(dir=root, suffix=".io") as fh:
        t = time.perf_counter()
        done = 0
        while done < nbytes:
            done += os.pwrite(fh.fileno(), view[: min(len(view), nbytes - done)], done)
        os.fsync(fh.fileno())
        return time.perf_counter() - t


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
