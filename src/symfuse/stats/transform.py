"""Statistics follow matching: express a model's statistics in the basis of its matched (transformed) version.

* Gram: exact for every module transform, by ``ModuleTransform.apply_to_gram(role, G)`` (``T G T^T`` on the
  layer's input; identity for layers reading the residual stream). Linear layers outside the attention / FFN
  modules (pooler, classifier) read the residual stream, which per-module transforms leave unchanged.
* Diagonal Fisher: exact only for transforms that map each parameter entry to ONE entry times a constant:
  permutations (head, FFN) move entries (``F' = F[perm]``) and scalings ``w' = s w`` give ``F' = F / s^2``.
  A rotation mixes entries, and the diagonal of ``R F R^T`` needs the off-diagonal Fisher we never stored, so
  :func:`transform_stats` returns None: the caller RECOLLECTS the Fisher on the matched model. This is a
  deliberate choice (exactness over an approximation such as ``diag(R diag(F) R^T)``).
* A residual-stream permutation also changes the inputs of the heads and embeddings, which the module keys do
  not describe: both kinds return None (recollect).

Each saved part is looked up in :mod:`symfuse.symmetry.registry` by its name: its kind's ``gram`` flag says whether
Grams follow it, its ``fisher`` function maps a diagonal Fisher (no function, or no registered kind: recollect).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from symfuse.checkpoint import CheckpointReader
from symfuse.stats.io import StatsFile, file_fingerprint, save_stats
from symfuse.stats.ownership import RESIDUAL_MAP_FILE, TRANSFORMS_FILE, model_fingerprint
from symfuse.symmetry.registry import kind_of_part

log = logging.getLogger(__name__)


def fisher_follows(part: str) -> bool:
    """Whether a diagonal Fisher follows transform parts named ``part`` exactly (its kind declares how)."""
    kind = kind_of_part(part)
    return kind is not None and kind.fisher is not None


def gram_follows(part: str) -> bool:
    """Whether Grams follow parts named ``part`` by ``apply_to_gram`` (unregistered parts: their own method)."""
    kind = kind_of_part(part)
    return kind is None or kind.gram


def _fisher_part(part):
    """The transform that maps a diagonal Fisher like ``part`` maps weights (its kind's ``fisher`` function)."""
    kind = kind_of_part(part.name)
    assert kind is not None and kind.fisher is not None, part.name  # checked by fisher_follows first
    return kind.fn("fisher")(part)


def transform_stats(
    stats_file: Path,
    transforms_file: Path,
    model: str | Path,
    out_file: Path,
) -> Path | None:
    """Apply matching transforms to a statistics file.

    Args:
        stats_file: ``gram.safetensors`` or ``fisher.safetensors`` of the SOURCE model.
        transforms_file: ``transforms.safetensors`` from matching (module key -> transform).
        model: The source (or matched) checkpoint: gives the architecture, config and tensor names.
        out_file: Where to write the transformed statistics (atomic).

    The result records ``transforms_fingerprint`` and ``source_model_fingerprint``, and, when ``model`` is the
    matched folder holding these transforms, its ``model_fingerprint``: a merge pairs it with that model only.

    Returns:
        ``out_file``, or None when the statistics cannot follow the transforms exactly (diagonal Fisher under a
        rotation, any kind under a residual permutation or a residual-orthogonal map): recollect them on the matched
        model instead.

    Raises:
        ValueError: if the file is not a Gram or Fisher statistics file.
    """
    from symfuse.symmetry import load_transforms

    sf = StatsFile(stats_file)
    if (Path(transforms_file).parent / RESIDUAL_MAP_FILE).is_file():  # its parts act in the norm-folded basis
        log.warning("%s: %s maps the whole residual stream (norms folded); recollect %s on the matched model",
                    stats_file, Path(transforms_file).parent, sf.kind)  # fmt: skip
        return None
    if sf.kind not in ("gram", "fisher"):
        raise ValueError(f"{stats_file}: kind {sf.kind!r} is neither 'gram' nor 'fisher'")
    transforms = load_transforms(transforms_file)
    parts = {p.name for mt in transforms.values() for p in mt.parts}
    unsupported = sorted(p for p in parts if not gram_follows(p))
    if unsupported:
        log.warning("%s: %s in %s (statistics cannot follow); recollect %s on the matched model",
                    stats_file, ", ".join(unsupported), transforms_file, sf.kind)  # fmt: skip
        return None
    inexact = sorted(p for p in parts if not fisher_follows(p)) if sf.kind == "fisher" else []
    if inexact:
        log.info("%s: diagonal Fisher cannot follow %s exactly; recollect it on the matched model", stats_file, inexact)
        return None
    reader = CheckpointReader(model)
    try:
        out = (_follow_gram if sf.kind == "gram" else _follow_fisher)(sf, transforms, reader)
    finally:
        reader.close()
    return save_stats(out, os.fspath(out_file), _followed_meta(sf, out, stats_file, transforms_file, model))


def _follow_gram(sf: StatsFile, transforms: dict, reader: CheckpointReader) -> dict[str, torch.Tensor]:
    """Each module's Grams under its transform (``apply_to_gram`` of the role's input)."""
    owner = {}
    for ref in reader.modules():
        for role, path in reader.spec.module_paths(ref, reader.config, reader.prefix).items():
            owner[path] = (ref.key, role)
    out: dict[str, torch.Tensor] = {}
    for key in sf.keys():  # noqa: SIM118
        g = sf.get(key)
        hit = owner.get(key)
        if hit is not None and hit[0] in transforms:
            g = transforms[hit[0]].apply_to_gram(hit[1], g)
        out[key] = g.contiguous()
    return out


def _follow_fisher(sf: StatsFile, transforms: dict, reader: CheckpointReader) -> dict[str, torch.Tensor]:
    """The diagonal Fisher of each module moved like its weights (exact parts only: permutations, scalings)."""
    spec, cfg, prefix = reader.spec, reader.config, reader.prefix
    out = {k: sf.get(k) for k in sf.keys()}  # noqa: SIM118
    for ref in reader.modules():
        mt = transforms.get(ref.key)
        if mt is None or not mt.parts:
            continue
        fisher = spec.read_module(out.__getitem__, out.__contains__, ref, cfg, prefix)
        for part in mt.parts:
            fisher = _fisher_part(part).apply(fisher)
        out.update(spec.write_module(fisher, ref, cfg, prefix))
    return out


def _followed_meta(
    sf: StatsFile, out: dict[str, torch.Tensor], stats_file: Path, transforms_file: Path, model: str | Path
) -> dict:
    """The followed file's metadata: where it came from, and whose statistics it now is (see transform_stats)."""
    meta = dict(sf.meta)
    if sf.kind == "gram" and sf.same_input:  # modules reading one input keep identical Grams; record only those
        meta["same_input"] = {k: v for k, v in sf.same_input.items() if torch.equal(out[k], out[v])}
    meta["transforms"] = str(transforms_file)
    meta["transformed_from"] = str(stats_file)
    # the statistics now belong to the matched model: the one whose folder holds these very transforms
    tfp = file_fingerprint(transforms_file)
    meta["transforms_fingerprint"] = tfp
    source_fp = meta.pop("model_fingerprint", None)
    if source_fp:
        meta["source_model_fingerprint"] = source_fp
    own = Path(model) / TRANSFORMS_FILE
    if own.is_file() and file_fingerprint(own) == tfp:
        meta["model_fingerprint"] = model_fingerprint(model)
    return meta
