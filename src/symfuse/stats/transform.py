"""Statistics follow matching (placeholder until the symmetry package lands)."""

from __future__ import annotations

from pathlib import Path


def transform_stats(stats_file: Path, transforms_file: Path, model: str | Path, out_file: Path) -> Path | None:
    """Apply matching transforms to statistics (see the final version)."""
    raise NotImplementedError
