"""``symfuse inspect``: before any merge, will alignment help and will the merge work? The library side.

:func:`inspect_models` compares every model with the first (the anchor): family and shapes, the weight distance
before and after each symmetry kind (:mod:`symfuse.inspect.distances`), with data the loss along the straight path
and the merge-vs-ensemble gap (:mod:`symfuse.inspect.paths`), and a verdict (:mod:`symfuse.inspect.verdict`, which
imports no torch: the command line reads its thresholds for ``--help``). :mod:`symfuse.inspect.render` prints the
table and draws the figure.
"""

from typing import Any

__all__ = ["inspect_models", "inspect_pair"]


def __getattr__(name: str) -> Any:
    """The functions of :mod:`symfuse.inspect.models`, imported on first use (torch loads with them)."""
    if name in __all__:
        from symfuse.inspect import models

        return getattr(models, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
