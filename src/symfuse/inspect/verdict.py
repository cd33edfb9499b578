"""The verdict of ``symfuse inspect``: will alignment help, will the merge work? Thresholds stated once, here.

Distances are over every attention and FFN module, relative to the anchor's norm there (``|B - A| / |A|``); the
"cut" of an alignment is how much it lowers that relative distance (``before - after``, in units of ``|A|``), and its
"share" that cut over ``before``. The best alignment is the lower of all per-module kinds together and (pre-norm
families) ``residual-orthogonal``. Barriers (``--data``) are relative to the mean loss of the two end models.

* ``incompatible``: different families or shapes; or, with data, the barrier after alignment stays above
  :data:`HIGH_BARRIER` of the end models' loss; or, without data, the relative distance after alignment stays at or
  above :data:`FAR` while alignment cuts less than :data:`SMALL_SHARE` of it, or the whole model's (embeddings,
  norms and head included) stays at or above :data:`FAR`. Expect a poor merge.
* ``same-basin``: alignment cuts the relative distance by less than :data:`NO_OP_CUT` (1 % of ``|A|``). It is a
  no-op: merge directly.
* ``align-first``: otherwise: align (``symfuse match``), then merge.
"""

from __future__ import annotations

NO_OP_CUT = 0.01  # alignment lowers |B - A| / |A| by less than this: a no-op
FAR = 1.0  # |B' - A| / |A| at or above this after alignment ...
SMALL_SHARE = 0.10  # ... while alignment removed less than this share of the distance: nothing in common
HIGH_BARRIER = 0.5  # the barrier after alignment above this share of the end models' mean loss

SAME_BASIN, ALIGN_FIRST, INCOMPATIBLE = "same-basin", "align-first", "incompatible"
ORDER = (SAME_BASIN, ALIGN_FIRST, INCOMPATIBLE)  # the overall verdict of several pairs is the worst

THRESHOLDS_HELP = (
    f"{SAME_BASIN}: alignment moves |B-A|/|A| by < {NO_OP_CUT:.0%} (a no-op: merge directly); "
    f"{INCOMPATIBLE}: another family or shape, or after alignment the barrier stays > {HIGH_BARRIER:.0%} of the end "
    f"loss (--data), or |B-A|/|A| stays >= {FAR:g} with < {SMALL_SHARE:.0%} of it removed, or the whole model's "
    f"stays >= {FAR:g} (no data); "
    f"{ALIGN_FIRST}: otherwise."
)


def _best(total: dict) -> tuple[str, float]:
    """The alignment that brought the source closest (all per-module kinds together, or the whole-model one)."""
    after = {k: v for k, v in total["after"].items() if k in ("all", "residual-orthogonal")}
    kind = min(after, key=after.__getitem__) if after else "all"
    return kind, after.get(kind, total["before"])


def pair_verdict(weights: dict, paths: dict | None = None) -> tuple[str, str]:
    """``(verdict, reason)`` of one compatible pair from its figures.

    Args:
        weights: :meth:`symfuse.inspect.distances.WeightFigures.as_dict`.
        paths: :func:`symfuse.inspect.paths.path_figures` (None: no data).

    Returns:
        The verdict and one sentence giving the figures it rests on.
    """
    total = weights["total"]
    before = total["before"]
    kind, after = _best(total)
    cut = before - after
    share = cut / before if before > 0 else 0.0
    kind = "all per-module kinds" if kind == "all" else kind
    moved = f"alignment ({kind}) moves |B-A|/|A| from {before:.3g} to {after:.3g} (by {cut:.3g}, {share:.0%} of it)"
    if paths is not None:
        plain, aligned = paths["plain"], paths["aligned"]
        barrier = (
            f"the loss barrier is {plain['barrier']:.3g} ({plain['rel_barrier']:.0%} of the end loss) plain and "
            f"{aligned['barrier']:.3g} ({aligned['rel_barrier']:.0%}) aligned"
        )
        if aligned["rel_barrier"] > HIGH_BARRIER:
            return INCOMPATIBLE, f"{barrier}: above {HIGH_BARRIER:.0%} even after alignment, expect a poor merge"
        moved = f"{moved}; {barrier}"
    if paths is None and after >= FAR and share < SMALL_SHARE:  # before the no-op test: far apart, and it stays so
        return INCOMPATIBLE, f"{moved}: still >= {FAR:g} and less than {SMALL_SHARE:.0%} removed, expect a poor merge"
    whole = weights.get("whole_model") or {}
    rest = min((whole.get("after") or {}).values(), default=whole.get("before", 0.0))
    if paths is None and rest >= FAR and after < FAR:  # embeddings, norms or a head apart: no module map reaches them
        outside = "the tensors outside attention / FFN (embeddings, norms, head) differ, expect a poor merge"
        return INCOMPATIBLE, f"{moved}, but the whole model stays {rest:.3g} apart after alignment: {outside}"
    if cut < NO_OP_CUT:
        return SAME_BASIN, f"{moved}: by less than {NO_OP_CUT:g}, a no-op — merge directly"
    return ALIGN_FIRST, f"{moved} — align with symfuse match, then merge"


def overall(verdicts: list[str]) -> str:
    """The verdict of several pairs: the worst of theirs."""
    return max(verdicts, key=ORDER.index)
