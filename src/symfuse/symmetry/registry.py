"""The symmetry kinds: one registry read by the matchers, ``disguise``, the statistics transform, the CLI, the config.

A kind is a :class:`SymmetryKind` declaration: its name, the module it acts on, the transform parts it produces,
whether it is exact, and references to its code (``"package.module:function"`` strings, imported on first use, or
the functions themselves):

* ``draw(ref, geo, generator, log_scale) -> tuple[Transform, ...]``: a random instance for ``disguise`` (exact kinds
  only: a disguised model computes the same function);
* ``weights(src, anc, geo, symmetries, key, timings) -> ModuleTransform``: finds the kind from canonical module
  weights (source onto anchor). Kinds declaring the SAME function are solved jointly by one call (rotation, scaling
  and head permutation share :func:`symfuse.match.weights.match_attention`), which reads ``symmetries`` to know
  which of them were asked for;
* ``activations(stats, ref, geo) -> tuple[Transform, ...]``: finds it from paired activation statistics
  (:func:`symfuse.match.activation.match_activations`); a kind with only ``weights`` is then fitted on the
  weights of the activation-matched source;
* ``fisher(part) -> Transform | None``: the transform that maps a diagonal Fisher the way ``part`` maps weights
  (None, or no ``fisher``: not exact, the Fisher is recollected on the matched model); ``gram``: whether Grams
  follow exactly by ``Transform.apply_to_gram`` (False: recollect).

Which kinds a command offers follows from the declarations: ``symfuse match`` (weights) and the run config take the
kinds with ``weights``, ``match --data`` those with ``activations`` or ``weights``, ``disguise`` those with ``draw``.
``stage`` orders the parts of one module's transform (lower first; a random draw consumes the generator in that
order). ``restricted_by`` names :class:`symfuse.arch.Geometry` flags under which the kind's draw and finder leave
some parts out because they would not be exact (``qk_norm``: Qwen3's per-head q/k norms forbid QK maps).
``acts_on`` may name both modules (``("attn", "ffn")``: one finder for every module), and ``excludes`` kinds that
cannot be asked for together with it (the config, the CLI and the matchers refuse the pair in one line). An inexact
kind (``exact=False``, e.g. a soft alignment) declares no ``draw``, and its own parts ``gram=False`` / no ``fisher``.

For example, an optimal-transport alignment of attention heads and FFN neurons that replaces the permutations
(exact parts ``ffn_perm`` / ``head_perm`` where its plan is a permutation, soft ``*_transport`` parts otherwise)::

    register_kind(SymmetryKind("ot", ("attn", "ffn"), ("ffn_transport", "head_transport"), exact=False,
                               weights="symfuse.match.ot:find_ot", gram=False,
                               excludes=("ffn-permutation", "head-permutation")))

How to add a kind (its own file plus one registration line):

1. ``src/symfuse/symmetry/<name>.py`` (or ``match/<name>.py`` for a finder): the :class:`Transform` subclass of its
   part (decorated with ``@register_transform`` so transforms files load it) and its ``draw`` / ``weights`` /
   ``activations`` / ``fisher`` functions;
2. one line at the end of this module::

       register_kind(SymmetryKind("<name>", "ffn", ("<part name>",), weights="symfuse.match.<name>:find", ...))

   A plug-in or a test registers it from anywhere with the same call (functions may be given directly) and may
   ``unregister_kind("<name>")`` afterwards.

This module imports no torch: the names and capabilities are known before any implementation loads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from symfuse.errors import UnknownChoiceError
from symfuse.registry import Registry, resolve

Capability = Literal["weights", "activations", "draw"]


@dataclass(frozen=True)
class SymmetryKind:
    """One kind of (exact) symmetry: what it transforms and where its code is (see the module docstring).

    Attributes:
        name: The name users give (``--symmetries``, ``--kinds``, ``RunConfig.symmetries``).
        acts_on: ``attn`` and / or ``ffn`` (one transform per module; a tuple for both), or ``residual`` (one
            transform of the whole stream).
        parts: ``Transform.name`` of the parts it introduces (how statistics find the kind of a saved part); parts
            it may also produce that another kind introduced (an FFN permutation) follow that kind's declaration.
        exact: Function-preserving (a matched or disguised model computes the same function).
        stage: Position of its parts within a module's transform (lower first).
        draw: Random draw for ``disguise``, or None.
        weights: Finder from module weights, or None.
        activations: Finder from paired activation statistics, or None.
        fisher: Maps a part to the transform of a diagonal Fisher, or None (recollect).
        gram: Grams follow its parts by ``apply_to_gram`` (False: recollect).
        restricted_by: Geometry flags under which some of its parts are left out (not exact there).
        excludes: Kinds it cannot be asked for together with (e.g. one alignment replacing the permutations).
    """

    name: str
    acts_on: str | tuple[str, ...]
    parts: tuple[str, ...]
    exact: bool = True
    stage: int = 0
    draw: Callable[..., Any] | str | None = None
    weights: Callable[..., Any] | str | None = None
    activations: Callable[..., Any] | str | None = None
    fisher: Callable[..., Any] | str | None = None
    gram: bool = True
    restricted_by: tuple[str, ...] = ()
    excludes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        acts_on = (self.acts_on,) if isinstance(self.acts_on, str) else tuple(self.acts_on)
        object.__setattr__(self, "acts_on", acts_on)
        if not acts_on or not (set(acts_on) <= {"attn", "ffn"} or acts_on == ("residual",)):
            raise ValueError(f"symmetry kind {self.name!r}: acts_on {acts_on} is not attn and / or ffn, or residual")
        if self.draw is not None and not self.exact:
            raise ValueError(f"symmetry kind {self.name!r}: only an exact kind may have a random draw (disguise)")
        if not self.parts:
            raise ValueError(f"symmetry kind {self.name!r}: name the transform parts it produces")

    def fn(self, what: Literal["draw", "weights", "activations", "fisher"]) -> Callable[..., Any]:
        """The function behind ``what`` (imported now when given as a string).

        Raises:
            ValueError: the kind has no such function.
        """
        ref = getattr(self, what)
        if ref is None:
            raise ValueError(f"symmetry kind {self.name!r} has no {what} function")
        return resolve(ref)

    def offers(self, capability: Capability) -> bool:
        """Whether a command needing ``capability`` can use it (``activations``: found from activations or weights)."""
        if capability == "activations":
            return self.activations is not None or self.weights is not None
        return getattr(self, capability) is not None


SYMMETRY_KINDS: Registry[SymmetryKind] = Registry("symmetry kind")


def _same_ref(a: Any, b: Any) -> bool:
    return a == b or (a is not None and b is not None and resolve(a) is resolve(b))


def register_kind(kind: SymmetryKind) -> SymmetryKind:
    """Register ``kind`` under its name; return it.

    Several kinds may produce one part (e.g. two finders of FFN permutations) when they agree on how statistics
    follow it (``gram`` and ``fisher``): statistics look a saved part up by its name.

    Raises:
        ValueError: the name is taken, or a part it shares with another kind follows statistics differently there.
    """
    if not isinstance(kind, SymmetryKind):
        raise TypeError(f"register_kind needs a SymmetryKind, got {kind!r}")
    if kind.name in SYMMETRY_KINDS:
        raise ValueError(f"symmetry kind {kind.name!r} is already registered; unregister it first")
    for other in SYMMETRY_KINDS.values():
        shared = [p for p in kind.parts if p in other.parts]
        if shared and (kind.gram != other.gram or not _same_ref(kind.fisher, other.fisher)):
            raise ValueError(
                f"symmetry kind {kind.name!r}: parts {shared} also come from {other.name!r}, whose statistics "
                "follow them differently — declare the same gram and fisher"
            )
    SYMMETRY_KINDS.register(kind.name, kind)
    return kind


def unregister_kind(name: str) -> None:
    """Remove a registered kind (a test's toy one)."""
    SYMMETRY_KINDS.unregister(name)


def kind_names(capability: Capability | None = None) -> tuple[str, ...]:
    """Registered kinds (offering ``capability``), in registration order."""
    return tuple(n for n, k in SYMMETRY_KINDS.items() if capability is None or k.offers(capability))


def check_kinds(
    names: Iterable[str], capability: Capability | None = None, what: str = "symmetries"
) -> tuple[str, ...]:
    """``names`` as a tuple, or one line naming the unknown (or not offering ``capability``) ones and the choices.

    Raises:
        UnknownChoiceError: a name is not registered or its kind lacks ``capability``.
        ValueError: two names exclude each other (``excludes``).
    """
    names = tuple(names)
    choices = kind_names(capability)
    unknown = [n for n in names if n not in choices]
    if unknown:
        raise UnknownChoiceError(f"unknown {what} {', '.join(map(repr, unknown))} — choose from {', '.join(choices)}")
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            if b in SYMMETRY_KINDS[a].excludes or a in SYMMETRY_KINDS[b].excludes:
                raise ValueError(f"{what} {a} and {b} exclude each other — take one of them")
    return names


def module_kind_names(capability: Capability | None = None) -> tuple[str, ...]:
    """:func:`kind_names` without the kinds acting on the whole residual stream.

    Those are one map per model, not per module: the pipeline's per-module matching tasks cannot find them.
    """
    return tuple(n for n in kind_names(capability) if SYMMETRY_KINDS[n].acts_on != ("residual",))


def compatible_kinds(names: Iterable[str]) -> tuple[str, ...]:
    """``names`` less each one that excludes (or is excluded by) a name kept before it (the "every kind" defaults).

    E.g. every exact kind with a weight finder, in registration order, keeps ``rotation`` and ``scaling`` and drops
    ``head-linear``, which replaces them.
    """
    kept: list[str] = []
    for n in names:
        if not any(n in SYMMETRY_KINDS[k].excludes or k in SYMMETRY_KINDS[n].excludes for k in kept):
            kept.append(n)
    return tuple(kept)


def kinds_for(names: Sequence[str], acts_on: str, capability: Capability | None = None) -> list[SymmetryKind]:
    """The kinds among ``names`` acting on ``acts_on`` (attn, ffn, residual) offering ``capability``, by ``stage``."""
    kinds = [SYMMETRY_KINDS[n] for n in SYMMETRY_KINDS if n in names]
    kinds = [k for k in kinds if acts_on in k.acts_on and (capability is None or k.offers(capability))]
    return sorted(kinds, key=lambda k: k.stage)


def kind_of_part(part: str) -> SymmetryKind | None:
    """The (first registered) kind producing transform parts named ``part`` (None: no registered kind)."""
    return next((k for k in SYMMETRY_KINDS.values() if part in k.parts), None)


# What a Geometry flag in ``restricted_by`` leaves out, for the log of a match.
RESTRICTIONS = {
    "qk_norm": "per-head q/k norms make QK maps (rotations, scalings, invertible maps) inexact; only V/O maps (and "
    "permutations) are matched",
}


def restriction_notes(names: Sequence[str], geometry: Any) -> dict[str, str]:
    """``{flag: note}`` for each Geometry flag set on ``geometry`` that restricts one of the kinds ``names``."""
    flags = [f for n in names for f in SYMMETRY_KINDS[n].restricted_by if getattr(geometry, f, False)]
    return {f: RESTRICTIONS.get(f, f"{f} leaves some parts of the asked kinds out") for f in dict.fromkeys(flags)}


# the built-in kinds, one line each (strings: nothing is imported until a kind is used)
_W, _R, _F = "symfuse.match.weights", "symfuse.symmetry.random", "symfuse.symmetry.follow"
_A = "symfuse.match.activation"
register_kind(
    SymmetryKind(
        "rotation",
        "attn",
        ("qk_rot", "vo_rot"),
        stage=1,
        draw=f"{_R}:draw_rotation",
        weights=f"{_W}:match_attention",
        restricted_by=("qk_norm",),
    )
)
register_kind(
    SymmetryKind(
        "scaling",
        "attn",
        ("qk_scale", "vo_scale"),
        stage=2,
        draw=f"{_R}:draw_scaling",
        weights=f"{_W}:match_attention",
        fisher=f"{_F}:fisher_of_scaling",
        restricted_by=("qk_norm",),
    )
)
register_kind(
    SymmetryKind(
        "ffn-permutation",
        "ffn",
        ("ffn_perm",),
        draw=f"{_R}:draw_ffn_permutation",
        weights=f"{_W}:find_ffn_permutation",
        activations=f"{_A}:find_ffn_permutation",
        fisher=f"{_F}:fisher_of_permutation",
    )
)
register_kind(
    SymmetryKind(
        "head-permutation",
        "attn",
        ("head_perm",),
        draw=f"{_R}:draw_head_permutation",
        weights=f"{_W}:match_attention",
        activations=f"{_A}:find_head_permutation",
        fisher=f"{_F}:fisher_of_permutation",
    )
)
register_kind(
    SymmetryKind(
        "residual-permutation",
        "residual",
        ("resid_perm",),
        draw=f"{_R}:draw_residual_permutation",
        activations=f"{_A}:residual_permutation",
        gram=False,
    )
)
register_kind(
    SymmetryKind(  # one orthogonal map of the whole stream (exact group per family: ArchSpec.residual_group)
        "residual-orthogonal",
        "residual",
        ("resid_orth",),
        draw=f"{_R}:draw_residual_orthogonal",
        weights="symfuse.match.residual_orthogonal:align_residual_orthogonal",
        gram=False,
        excludes=("residual-permutation",),
    )
)
# head-linear (symfuse.symmetry.head_linear): an invertible map per KV group on each of the QK and OV circuits, the
# whole per-head group GL(dh) that rotation and scaling are subgroups of (which it replaces); RoPE restricts the QK map
# to a scaled rotation per frequency pair, per-head q/k norms forbid it. Found jointly with the head permutation (the
# heads are paired on their QK / OV circuits). A dense map does not carry a diagonal Fisher: recollected.
register_kind(
    SymmetryKind(
        "head-linear",
        "attn",
        ("qk_linear", "vo_linear"),
        stage=1,
        draw="symfuse.symmetry.head_linear:draw_head_linear",
        weights=f"{_W}:match_attention",
        restricted_by=("qk_norm",),
        excludes=("rotation", "scaling"),
    )
)

# OT fusion (symfuse.match.ot): soft alignment of heads and FFN neurons by optimal transport, in place of the
# permutations; exact parts (head_perm / ffn_perm) where the plan is a permutation ("ot" with equal widths), soft
# ``*_transport`` parts otherwise ("ot-soft", entropic: never exact) — statistics are then recollected.
_OT_PARTS = ("ffn_transport", "head_transport", "resid_transport")
_OT_EXCLUDES = ("ffn-permutation", "head-permutation")
register_kind(SymmetryKind("ot", ("attn", "ffn"), _OT_PARTS, exact=False, weights="symfuse.match.ot:find_ot", gram=False, excludes=(*_OT_EXCLUDES, "ot-soft")))  # noqa: E501  # fmt: skip
register_kind(SymmetryKind("ot-soft", ("attn", "ffn"), _OT_PARTS, exact=False, weights="symfuse.match.ot:find_ot", gram=False, excludes=(*_OT_EXCLUDES, "ot")))  # noqa: E501  # fmt: skip
