"""Label spaces shared between datasets (out-of-domain emotion evaluation)."""

from __future__ import annotations

from collections.abc import Iterable

# Ekman's basic emotions that the emotion datasets have in common (each dataset has some of them).
EMOTION_SHARED = ("anger", "disgust", "fear", "joy", "sadness", "surprise")


def shared_label_names(
    a: Iterable[str], b: Iterable[str], restrict: Iterable[str] | None = EMOTION_SHARED
) -> list[str]:
    """Class names two label spaces share, in ``a``'s order.

    Args:
        a: First label space (e.g. the evaluated dataset's classes).
        b: Second label space (e.g. the model head's classes).
        restrict: Keep only these names (default: the six Ekman emotions); None keeps every common name.

    Returns:
        The shared names (may be empty).
    """
    names_b = set(b)
    keep = set(restrict) if restrict is not None else None
    return [n for n in a if n in names_b and (keep is None or n in keep)]
