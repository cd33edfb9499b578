"""``disguise``: a checkpoint rewritten with random exact symmetry transforms (the matching tests' planted case).

Every module gets a random transform of the requested kinds (the registry's ``draw``); a residual-stream kind
permutes the whole stream. The transforms are saved next to the weights, so a matcher's result can be checked
against the truth.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from symfuse.arch import ModuleRef
from symfuse.checkpoint import CheckpointReader, write_checkpoint
from symfuse.device import resolve_device
from symfuse.io import check_finite, save_safetensors
from symfuse.match.inputs import REPORT_FILE, RESIDUAL_FILE, TRANSFORMS_FILE
from symfuse.outputs import atomic_output_dir, check_output
from symfuse.symmetry.random import ALL_KINDS, random_module_transform
from symfuse.symmetry.registry import check_kinds, kind_names, kinds_for
from symfuse.symmetry.residual import permute_residual
from symfuse.symmetry.transforms import save_transforms

# what `disguise` can apply, registered at import: the per-module kinds, plus one permutation of the residual stream
DISGUISE_KINDS = kind_names("draw")


def disguise_checkpoint(
    source: str | Path,
    out: Path,
    seed: int = 0,
    noise: float = 0.0,
    kinds: Sequence[str] = ALL_KINDS,
    overwrite: bool = False,
    device: str | torch.device = "cpu",
) -> Path:
    """Write SOURCE with random exact symmetry transforms of every module (plus optional relative noise).

    Args:
        source: Source checkpoint.
        out: Output folder (save_pretrained layout, plus the applied ``transforms.safetensors``).
        seed: Random seed.
        noise: Gaussian noise added to every module tensor after the transform, relative to that tensor's std
            (0 = exactly function-preserving).
        kinds: Registered kinds with a random draw (see :data:`DISGUISE_KINDS`), drawn module by module in stage
            order; a kind acting on the residual stream (``residual-permutation``) permutes the whole residual
            stream (embeddings, every module, norms and heads; saved in ``residual_permutation.safetensors`` as
            ``perm``, or ``perm.<stream>`` for each stream of a multi-stream family such as CLIP):
            it holds the whole model in memory, the other kinds stream module by module.
        overwrite: Replace an existing ``out`` (atomically, at the end).
        device: Where the transforms are applied (random draws are made on the CPU: the same disguise anywhere).

    Returns:
        ``out``.

    Raises:
        OutputExistsError: ``out`` exists and ``overwrite`` is False.
        UnknownChoiceError: (a ValueError) an unknown kind, or one without a random draw.
    """
    check_kinds(kinds, "draw", "disguise kinds")
    check_output(out, overwrite, inputs=[source])
    dev = resolve_device(device)
    g = torch.Generator().manual_seed(seed)
    gn = torch.Generator().manual_seed(seed + 1_000_003)
    with CheckpointReader(source) as src:
        check_finite(src.tensor_files.values())  # tensors outside the transformed modules were copied, NaN and all
        ts = {ref.key: random_module_transform(ref, src.geometry, g, kinds) for ref in src.modules()}

        def fn(ref: ModuleRef, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            new = ts[ref.key].apply({r: t.to(dev) for r, t in w.items()})
            if noise > 0:
                for r, t in new.items():
                    if t.is_floating_point() and t.numel() > 1:
                        tf = t.float()
                        draw = torch.randn(t.shape, generator=gn).to(dev)
                        new[r] = (tf + noise * tf.std() * draw).to(t.dtype)
            return {r: t.cpu() for r, t in new.items()}

        report = {"disguise_of": str(src.path), "seed": seed, "noise": noise, "kinds": list(kinds)}
        with atomic_output_dir(out, overwrite=overwrite) as tmp:
            stream = kinds_for(kinds, "residual")
            if stream and stream[0].name == "residual-orthogonal":
                _orthogonal_disguise(src, fn, g, tmp)
            elif stream:  # drawn after every module's transform (the generator's order), one per residual stream
                draw = stream[0].fn("draw")
                perms = {}
                for s, d in src.spec.streams(src.config).items():
                    (part,) = draw(None, dataclasses.replace(src.geometry, d_model=d), g, 0.5)
                    perms[s] = part.perm
                perm = perms[""] if list(perms) == [""] else perms
                write_checkpoint(src, tmp, replace=_residual_disguised(src, fn, perm), overwrite=True)
                save_safetensors({".".join(("perm", s)).rstrip("."): p for s, p in perms.items()}, tmp / RESIDUAL_FILE)
            else:
                write_modules(src, fn, tmp)
            save_transforms(ts, tmp / TRANSFORMS_FILE)
            (tmp / REPORT_FILE).write_text(json.dumps(report))
    return Path(out)


def _orthogonal_disguise(src: CheckpointReader, fn: Callable, g: torch.Generator, tmp: Path) -> None:
    """Modules transformed by ``fn``, norms folded, then a random map of the family's group on the whole stream."""
    from symfuse.match.residual_orthogonal import RESIDUAL_ORTHOGONAL_FILE, write_state
    from symfuse.symmetry.residual_orthogonal import check_supported, fold_norms, random_in_group, rotate_residual

    group = check_supported(src.spec)
    state = {n: src.get(n).clone() for n in src.names()}
    for ref in src.modules():
        w = src.spec.read_module(state.__getitem__, state.__contains__, ref, src.config, src.prefix)
        state.update(src.spec.write_module(fn(ref, w), ref, src.config, src.prefix))
    folded, untied = fold_norms(state, src.spec, src.config, src.prefix)
    rot = random_in_group(src.geometry.d_model, group, g)
    write_state(src, rotate_residual(folded, src.spec, src.config, rot, src.prefix), tmp, untied)
    save_safetensors({"rot": rot}, tmp / RESIDUAL_ORTHOGONAL_FILE, {"group": group})


def _residual_disguised(
    src: CheckpointReader,
    fn: Callable[[ModuleRef, dict[str, torch.Tensor]], dict[str, torch.Tensor]],
    perm: torch.Tensor | dict[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """Every tensor of ``src`` with ``fn`` applied to each module, then the residual stream(s) permuted by ``perm``.

    ``perm`` is ``{stream: perm}`` for a family with several streams (see :func:`permute_residual`).
    """
    state = {n: src.get(n).clone() for n in src.names()}
    for ref in src.modules():
        w = src.spec.read_module(state.__getitem__, state.__contains__, ref, src.config, src.prefix)
        state.update(src.spec.write_module(fn(ref, w), ref, src.config, src.prefix))
    src.close()
    return permute_residual(state, src.spec, src.config, perm, src.prefix)


def write_modules(
    src: CheckpointReader,
    fn: Callable[[ModuleRef, dict[str, torch.Tensor]], dict[str, torch.Tensor]],
    out: Path,
    shard_bytes: int = 512 * 1024**2,
) -> Path:
    """Stream ``src`` into ``out`` (overwritten) with each module's canonical weights replaced by ``fn(ref, w)``."""
    owner = src.tensor_owners()
    cache: dict[str, torch.Tensor] = {}

    def replace(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name in cache:
            return cache.pop(name)
        ref = owner.get(name)
        if ref is None:
            return tensor
        new = fn(ref, src.read_module(ref))
        cache.update(src.spec.write_module(new, ref, src.config, src.prefix))
        src.close()  # unmap (see _read)
        return cache.pop(name)

    return write_checkpoint(src, out, replace=replace, shard_bytes=shard_bytes, overwrite=True)
