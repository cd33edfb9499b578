"""Whether two checkpoints can be merged tensor by tensor: family, shapes, and the task heads that may differ.

Read by ``symfuse inspect`` (its verdict) and by the pipeline's pre-flight (a brought checkpoint against the base),
from the checkpoints' headers only.
"""

from __future__ import annotations

from symfuse.arch import Geometry
from symfuse.checkpoint import CheckpointReader


def describe(geo: Geometry) -> str:
    """``12 layers, d 768, 12 heads, ffn 3072`` (the first stack of a multi-stack model)."""
    g = geo.of(geo.stacks[0][0]) if geo.stacks else geo
    return f"{g.n_layers} layers, d {g.d_model}, {g.n_heads} heads, ffn {g.d_ffn}"


def _under_head(reader: CheckpointReader, name: str) -> bool:
    return any(name.startswith(h.path + ".") for h in reader.spec.head_paths(reader.prefix))


def shape_problems(
    src: CheckpointReader, anc: CheckpointReader, role: str = "the anchor"
) -> tuple[str | None, list[str]]:
    """Why two models cannot be merged tensor by tensor (None: they can), and the head tensors whose shapes differ.

    Family and geometry must agree, and every tensor both hold must have one shape, except task heads (a merge keeps
    one head per dataset): those are returned, to be left out of the whole-model figures.
    """
    if src.spec.family != anc.spec.family:
        return f"{src.path} is a {src.spec.family} model, {role} {anc.path} a {anc.spec.family} model", []
    if src.geometry != anc.geometry:
        return f"shapes differ: {describe(src.geometry)} against {role}'s {describe(anc.geometry)}", []
    heads = []
    for name in sorted(set(src.names()) & set(anc.names())):
        if src.shape(name) != anc.shape(name):
            if not _under_head(anc, name):
                return f"{name}: shape {src.shape(name)} against {role}'s {anc.shape(name)}", []
            heads.append(name)
    return None, heads
