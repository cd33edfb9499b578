"""Checkpoint-level matching: per-module matching from folders (lazy), assembling the matched folder, disguise.

Memory is O(one module) per worker: modules are read one at a time with :meth:`CheckpointReader.read_module`
and the matched checkpoint is streamed by :func:`symfuse.checkpoint.write_checkpoint`.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from symfuse.arch import ModuleRef
from symfuse.checkpoint import CheckpointReader, write_checkpoint
from symfuse.device import resolve_device
from symfuse.errors import CheckpointError
from symfuse.io import rows_per_block
from symfuse.match.closed_form import torch_threads
from symfuse.match.forward import plain_forward_supported
from symfuse.match.inputs import (  # noqa: F401  (names of this module's interface)
    REPORT_FILE,
    RESIDUAL_FILE,
    TRANSFORMS_FILE,
    check_compatible,
    check_finite,
    check_shapes,
    read_checked,
    strip_prefix,
)
from symfuse.match.output_check import VERIFY_MODES, StreamedReference
from symfuse.match.publish import AlignRequest, Found, publish_alignment
from symfuse.match.reading import PreadSource
from symfuse.match.verify import check_module_transform, is_exact, module_invariants
from symfuse.match.weights import (
    DEFAULT_SYMMETRIES,
    check_symmetries,
    match_module_weights,
    module_distance,
    sq_distance,
)
from symfuse.match.written import check_written
from symfuse.outputs import atomic_output_dir, check_output
from symfuse.runtime import module_workers
from symfuse.symmetry.registry import restriction_notes
from symfuse.symmetry.transforms import ModuleTransform, load_transforms, save_transforms

log = logging.getLogger(__name__)


def _reader(x: str | os.PathLike | CheckpointReader) -> CheckpointReader:
    return x if isinstance(x, CheckpointReader) else CheckpointReader(x)


def _sq_distance_to(tensor: torch.Tensor, source: PreadSource, name: str, chunk: int = 1 << 22) -> float | None:
    """``||tensor - stored name||²`` reading the stored tensor in row blocks (None if shapes or dtypes differ)."""
    dtype, shape = source.meta(name)
    if list(tensor.shape) != shape or not dtype.is_floating_point:
        return None
    if tensor.dim() == 0:
        return sq_distance(tensor, source.get(name))
    rows = rows_per_block(tensor.shape, chunk)
    return sum(
        sq_distance(tensor[i : i + rows], source.get_rows(name, i, i + rows)) for i in range(0, tensor.shape[0], rows)
    )


def save_transform(t: ModuleTransform, file: Path) -> Path:
    """Save one module transform (safetensors; the module key is kept)."""
    return save_transforms({t.key: t}, file)


def load_transform(file: Path) -> ModuleTransform:
    """Load one module transform written by :func:`save_transform`."""
    ts = load_transforms(file)
    if len(ts) != 1:
        raise CheckpointError(f"{file}: holds {len(ts)} module transforms, expected one")
    return next(iter(ts.values()))


def match_module(
    source: str | Path,
    anchor: str | Path,
    module_key: str,
    symmetries: Sequence[str] = DEFAULT_SYMMETRIES,
    device: str | torch.device = "cpu",
) -> ModuleTransform:
    """The transform mapping SOURCE's module ``module_key`` onto ANCHOR's (reads only that module's tensors).

    Args:
        source: Source checkpoint (folder, ``"minilm"`` or hub id).
        anchor: Anchor checkpoint of the same family and shapes.
        module_key: ``ModuleRef.key``, e.g. ``L03.attn``.
        symmetries: Subset of :data:`symfuse.match.SYMMETRIES`.
        device: Where the matching runs (the transform comes back on the CPU).

    Raises:
        CheckpointError: different families / shapes, missing or non-finite tensors.
    """
    check_symmetries(symmetries)
    dev = resolve_device(device)
    ref = ModuleRef.parse(module_key)
    with CheckpointReader(source) as src, CheckpointReader(anchor) as anc:
        check_compatible(src, anc)
        s, a = src.read_module(ref), anc.read_module(ref)
        check_shapes(ref, s, a, f"{src.path} vs {anc.path}")
        s, a = ({r: t.to(dev) for r, t in w.items()} for w in (s, a))
        return match_module_weights(ref, s, a, src.geometry, symmetries).to("cpu")


def _verify_mode(verify: str | None, logit_check: bool | None) -> str:
    if verify is None:
        return "none" if logit_check is False else "stream"
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify must be one of {', '.join(VERIFY_MODES)}, got {verify!r}")
    return verify


def _dtype(reader: CheckpointReader) -> torch.dtype:
    """The widest floating dtype stored (float32 unless every float tensor is half precision)."""
    dts = {reader.dtype(n) for n in reader.names()}
    return torch.float32 if dts & {torch.float32, torch.float64} else torch.bfloat16


class _Replacer:
    """``write_checkpoint``'s ``replace``: each module transformed and checked when the writer first needs it.

    Distances to the anchor (when given) are summed on the way.

    At most two modules' weights are alive at once (7B widths: source + anchor, then source + new, then new +
    anchor): the anchor is read twice rather than held while the transform runs.
    """

    def __init__(
        self,
        src: CheckpointReader,
        src_io: PreadSource,
        anc_io: PreadSource | None,
        mts: Mapping[str, ModuleTransform],
        where: str,
    ):
        self.src, self.src_io, self.anc_io, self.mts, self.where = src, src_io, anc_io, mts, where
        self.owner = src.tensor_owners()
        anc = anc_io.reader if anc_io is not None else None
        self.anc_names = {strip_prefix(n, anc.prefix): n for n in anc.names()} if anc is not None else {}
        self.cache: dict[str, torch.Tensor] = {}  # the written module's other tensors, until the writer asks
        self.per_module: list[dict[str, Any]] = []
        self.sq = {"before": 0.0, "after": 0.0}

    def __call__(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor to write under ``name`` (``tensor``: the source's)."""
        if name in self.cache:
            return self.cache.pop(name)
        ref = self.owner.get(name)
        if ref is None:
            self._outside(name, tensor)
            return tensor
        src = self.src
        self.cache.update(src.spec.write_module(self._module(ref), ref, src.config, src.prefix))
        src.close()  # unmap what the writer read so far
        return self.cache.pop(name)

    def _outside(self, name: str, tensor: torch.Tensor) -> None:
        check_finite({name: tensor}, f"{self.src.path}: tensor")
        other = self.anc_names.get(strip_prefix(name, self.src.prefix))
        if self.anc_io is not None and other is not None and tensor.is_floating_point():
            d = _sq_distance_to(tensor, self.anc_io, other)
            if d is not None:
                self.sq["before"] += d
                self.sq["after"] += d

    def _module(self, ref: ModuleRef) -> dict[str, torch.Tensor]:
        src, anc_io = self.src, self.anc_io
        w = read_checked(self.src_io, ref)
        mt = self.mts.get(ref.key)
        before = None
        if anc_io is not None:
            a = anc_io.read_module(ref)
            check_shapes(ref, w, a, f"{src.path} vs {anc_io.reader.path}")
            before = module_distance(w, a)
            del a
        # a soft (OT) map changes the module's function by design; otherwise the check's invariants are taken
        # before the transform, so the source is freed before the transformed module is checked
        before_inv = module_invariants(ref, w, src.geometry) if mt is not None and is_exact(mt) else None
        new = mt.apply(w) if mt is not None else w
        del w
        if before_inv is not None:
            check_module_transform(ref, before_inv, new, src.geometry, mt, self.where)
        if anc_io is not None:
            after = module_distance(new, anc_io.read_module(ref))
            self.sq["before"] += before**2
            self.sq["after"] += after**2
            self.per_module.append(
                {"module": ref.key, "kind": ref.kind, "distance_before": before, "distance_after": after}
            )
        return new


def assemble_matched(
    source: str | Path | CheckpointReader,
    transforms: Mapping[str, Path | ModuleTransform],
    out: Path,
    anchor: str | Path | CheckpointReader | None = None,
    symmetries: Sequence[str] | None = None,
    logit_check: bool | None = None,
    shard_bytes: int = 128 * 1024**2,
    extra_report: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    verify: str | None = None,
) -> dict:
    """Write SOURCE with every module transformed: save_pretrained folder + transforms + report.

    Each transform is checked on its module while it is applied (:func:`check_module_transform`); the written
    model's outputs are compared with SOURCE's by ``verify``.

    Args:
        source: Source checkpoint.
        transforms: Module key -> transform (or a file from :func:`save_transform`); absent modules are kept.
        out: Destination folder (must not exist; written atomically).
        anchor: When given, distances to it go in the report.
        symmetries: Recorded in the report.
        logit_check: Compare outputs of OUT and SOURCE (False: ``verify="none"``); None: ``verify``.
        shard_bytes: Largest shard written (bounds memory while streaming).
        extra_report: More report fields.
        overwrite: Replace an existing ``out`` (atomically, at the end).
        verify: ``stream`` (default: layer by layer, one layer in memory), ``full`` (both models loaded) or
            ``none`` (module checks only).

    Returns:
        The report (also written as ``symfuse_report.json``).

    Raises:
        OutputExistsError: ``out`` exists and ``overwrite`` is False.
        VerificationError: a transform or the written model fails its check (nothing is published).
    """
    t_start = time.perf_counter()
    verify = _verify_mode(verify, logit_check)
    files = [v for v in transforms.values() if not isinstance(v, ModuleTransform)]
    check_output(out, overwrite, inputs=[getattr(source, "path", source), getattr(anchor, "path", anchor), *files])
    mts = {k: (v if isinstance(v, ModuleTransform) else load_transform(Path(v))) for k, v in transforms.items()}
    src = _reader(source)  # an open reader is reused: each folder is opened and validated once per command
    anc = _reader(anchor) if anchor is not None else None
    if anc is not None:
        check_compatible(src, anc)
    out = Path(out)
    src_io = PreadSource(src)
    anc_io = PreadSource(anc) if anc is not None else None
    replace = _Replacer(src, src_io, anc_io, mts, str(out))
    report: dict[str, Any] = {
        "source": str(src.path),
        "anchor": str(anc.path) if anc is not None else None,
        "family": src.spec.family,
        "symmetries": list(symmetries) if symmetries is not None else None,
        # False when a part of an inexact kind (a soft OT map) is among them: not function-preserving
        "exact": all(is_exact(t) for t in mts.values()),
    }
    try:
        with atomic_output_dir(out, overwrite=overwrite) as tmp:
            write_checkpoint(src, tmp, replace=replace, shard_bytes=shard_bytes, overwrite=True)
            save_transforms(mts, tmp / TRANSFORMS_FILE)
            if anc is not None:
                report["distance_before"] = replace.sq["before"] ** 0.5
                report["distance_after"] = replace.sq["after"] ** 0.5
            report.update(check_written(tmp, src.path, report["exact"], verify, _dtype(src)))  # as written
            report["per_module"] = sorted(replace.per_module, key=lambda r: ModuleRef.parse(r["module"]))
            report.update(extra_report or {})
            report["seconds"] = report.get("seconds", 0.0) + time.perf_counter() - t_start
            (tmp / REPORT_FILE).write_text(json.dumps(report, indent=2))
    finally:
        src.close()
        src_io.close()
        if anc is not None:
            anc.close()
        if anc_io is not None:
            anc_io.close()
    return report


def match_all_modules(
    src: CheckpointReader,
    anc: CheckpointReader,
    symmetries: Sequence[str],
    workers: int | None = None,
    timings: dict[str, float] | None = None,
) -> dict[str, ModuleTransform]:
    """Match every module of two open checkpoints (modules in parallel threads; O(module) memory each)."""
    refs = src.modules()
    if workers is None:  # big modules (7B widths) one at a time to bound memory
        workers = module_workers(src.geometry.d_model, src.geometry.d_ffn)
    src_io, anc_io = PreadSource(src), PreadSource(anc)

    def one(ref: ModuleRef) -> ModuleTransform:
        t0 = time.perf_counter()
        s, a = read_checked(src_io, ref), read_checked(anc_io, ref)
        if timings is not None:
            timings["io"] = timings.get("io", 0.0) + time.perf_counter() - t0
        check_shapes(ref, s, a, f"{src.path} vs {anc.path}")
        out = match_module_weights(ref, s, a, src.geometry, symmetries, timings)
        del s, a
        return out

    def one_single_threaded(ref: ModuleRef) -> ModuleTransform:
        # parallel workers: one torch thread each (no oversubscription; torch thread counts are per thread)
        with torch_threads(1):
            return one(ref)

    with src_io, anc_io:
        if workers <= 1:
            results = [one(r) for r in refs]
        else:
            # biggest first (FFNs: cost matrix + assignment), attention last: the small modules fill the gaps,
            # so the workers finish together instead of one idling while the other ends on an FFN
            order = sorted(refs, key=lambda r: r.kind != "ffn")
            with ThreadPoolExecutor(workers) as pool:
                done = dict(zip(order, pool.map(one_single_threaded, order), strict=True))
            results = [done[r] for r in refs]
    return {r.key: t for r, t in zip(refs, results, strict=True)}


def match_checkpoints(
    source: str | Path,
    anchor: str | Path,
    out: Path,
    symmetries: Sequence[str] = DEFAULT_SYMMETRIES,
    workers: int | None = None,
    logit_check: bool | None = None,
    overwrite: bool = False,
    verify: str | None = None,
    device: str | torch.device = "cpu",
) -> dict:
    """The ``weights`` alignment: match SOURCE onto ANCHOR module by module and write the matched folder.

    One pass (:func:`symfuse.match.pipeline.match_and_write`): each module is read, matched, transformed, checked
    (:func:`check_module_transform`) and written by one worker; then the written model's outputs are compared
    with SOURCE's (``verify``) and the folder is published (:func:`symfuse.match.publish.publish_alignment`).
    Kinds acting on the whole stream at once (``residual-orthogonal``) go through
    :func:`symfuse.match.align.align_checkpoints`.

    Args:
        source: Source checkpoint.
        anchor: Anchor checkpoint (same family and shapes).
        out: Output folder (must not exist; not created on error).
        symmetries: Subset of :data:`symfuse.match.SYMMETRIES`.
        workers: Threads matching modules in parallel (None: :func:`symfuse.runtime.module_workers`).
        logit_check: See :func:`assemble_matched`.
        overwrite: Replace an existing ``out`` (atomically, at the end).
        verify: ``stream`` (default), ``full`` or ``none`` (see :func:`assemble_matched`).
        device: Where the matching runs (``cpu``, ``cuda``, ``cuda:N``, ``auto``; one module at a time on it).

    Returns:
        The report (:func:`symfuse.match.report.alignment_report`; the driver adds ``per_module``,
        ``match_seconds`` and ``timings``).

    Raises:
        ValueError: ``residual-orthogonal`` among the symmetries.
        VerificationError: a module's transform or the written model fails its check (nothing is published).
    """
    symmetries = check_symmetries(symmetries)
    if "residual-orthogonal" in symmetries:
        raise ValueError("residual-orthogonal maps the whole stream at once — align with align_checkpoints")
    request = AlignRequest(source, anchor, Path(out), symmetries, workers=workers, overwrite=overwrite,
                           verify=_verify_mode(verify, logit_check), device=resolve_device(device))  # fmt: skip
    return publish_alignment(request, "weights", weights_step)


def weights_step(request: AlignRequest, tmp: Path) -> Found:
    """The ``weights`` driver's step (:data:`symfuse.match.publish.Step`): match module by module into ``tmp``."""
    from symfuse.match.pipeline import match_and_write

    t0 = time.perf_counter()
    symmetries, verify, dev = request.kinds, request.verify, resolve_device(request.device)
    timings: dict[str, float] = {}
    with CheckpointReader(request.source) as src, CheckpointReader(request.anchor) as anc:  # headers read once
        check_compatible(src, anc)
        for note in restriction_notes(symmetries, src.geometry).values():
            log.info("%s: %s", src.spec.family, note)
        # the streamed check's SOURCE pass runs in the background: with transformers' model (its skeleton and
        # imports are slow) while matching; with the plain forward (fast, ~20 MiB) beside the matched model's pass,
        # once matching has freed its memory (so the check does not raise the command's peak)
        plain = plain_forward_supported(src.spec, src.config)
        reference = StreamedReference(src.path) if verify == "stream" and not plain else None
        try:
            transforms, per_module, before, after = match_and_write(
                src, anc, tmp, symmetries, workers=request.workers, timings=timings, where=str(request.out),
                device=dev,
            )  # fmt: skip
            save_transforms(transforms, tmp / TRANSFORMS_FILE)
        except BaseException:
            if reference is not None:
                reference.close()
            raise
        if verify == "stream" and plain:
            reference = StreamedReference(src.path)
        extra = {"per_module": per_module, "match_seconds": time.perf_counter() - t0, "timings": timings}
        return Found(
            str(src.path), str(anc.path), src.spec.family, list(symmetries),
            exact=all(is_exact(t) for t in transforms.values()),  # False: a soft (OT) map among them
            distance_before=before, distance_after=after, dtype=_dtype(src), device=str(dev), verify=verify,
            reference=reference, extra=extra,
        )  # fmt: skip
