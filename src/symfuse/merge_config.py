"""The ``symfuse merge --config merge.yaml`` file: one validated YAML document per merge (like mergekit's).

Field names mirror :class:`symfuse.config.RunConfig` where it has them (``strategy`` is one of its ``strategies``,
``params.alpha`` is its ``regmean_alpha``, ``base`` its ``base_model``); ``params`` holds the strategy's typed
parameters, the same as the ``merge`` command's flags. Relative paths are read from the current folder, as the
flags are. Example::

    strategy: regmean
    models: [ft/isear, ft/meld]
    stats: [stats/isear, stats/meld]
    weights: [1, 2]
    params: {alpha: 0.9}

This module imports only pydantic and yaml: a bad file fails before torch is imported.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError

from symfuse.config import Strategy, _Strict
from symfuse.errors import UsageError


class MergeFileParams(_Strict):
    """A strategy's parameters (give only those the strategy reads; the others are refused)."""

    alpha: float | None = Field(default=None, ge=0, le=1, description="RegMean off-diagonal scale (0.9).")
    lam: float | None = Field(default=None, allow_inf_nan=False, description="Task-vector scale.")
    density: float | None = Field(default=None, gt=0, le=1, description="TIES: fraction of each task vector kept.")
    drop: float | None = Field(default=None, ge=0, lt=1, description="DARE drop rate.")
    combine: Literal["task-arithmetic", "ties"] | None = Field(default=None, description="DARE: how to combine.")
    seed: int | None = Field(default=None, description="DARE seed.")
    dtype: Literal["float64", "float32"] | None = Field(default=None, description="RegMean precision.")
    epsilon: float | None = Field(default=None, gt=0, allow_inf_nan=False, description="Fisher floor.")
    data: list[str] | None = Field(default=None, description="regmean++: each model's own dataset, in model order.")
    max_examples: int | None = Field(default=None, gt=0, description="regmean++: examples per dataset for its Grams.")
    device: str | None = Field(default=None, description="regmean++: where its forward passes run (cpu, cuda).")


class MergeFile(_Strict):
    """One merge: which models, with which strategy and parameters (the output folder is given on the command line)."""

    strategy: Strategy = Field(description="Merge strategy (one of RunConfig.strategies' choices).")
    models: list[str] = Field(min_length=2, description="Checkpoints to merge (two or more).")
    stats: list[str] | None = Field(default=None, description="One statistics folder (or file) per model, in order.")
    base: str | None = Field(default=None, description="Base checkpoint (task-vector strategies).")
    weights: list[float] | None = Field(default=None, description="One weight per model (>= 0, positive sum).")
    params: MergeFileParams = Field(default_factory=MergeFileParams, description="The strategy's parameters.")


def load_merge_file(path: str | Path) -> MergeFile:
    """Read and validate ``path``.

    Raises:
        UsageError: one line naming the file and the offending key (missing file, bad YAML, unknown key, wrong type).
    """
    path = Path(path)
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise UsageError(f"--config: {path} {what} — give a merge YAML file")
    try:
        data: Any = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise UsageError(f"{path}: not valid YAML{where} — fix the syntax") from exc
    if not isinstance(data, dict):
        raise UsageError(
            f"{path}: expected a mapping (strategy:, models:, ...), got {type(data).__name__} — see README"
        )
    try:
        return MergeFile.model_validate(data)
    except ValidationError as exc:
        # a misspelt key first: it is why the right one is missing
        e = sorted(exc.errors(), key=lambda e: e["type"] != "extra_forbidden")[0]
        key = ".".join(map(str, e["loc"])) or "(top level)"
        if e["type"] == "extra_forbidden":
            model = MergeFileParams if e["loc"][0] == "params" else MergeFile
            fix = f"remove it or fix its spelling (keys: {', '.join(model.model_fields)})"
        elif e["type"] == "missing":
            fix = "add it"
        else:
            fix = "fix its value"
        raise UsageError(f"{path}: {key}: {e['msg']} — {fix}") from exc
