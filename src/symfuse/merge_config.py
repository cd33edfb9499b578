"""The ``symfuse merge --config merge.yaml`` file: one validated YAML document per merge (like mergekit's).

Field names mirror :class:`symfuse.config.RunConfig` where it has them (``strategy`` is one of its ``strategies``,
``params`` is its ``merge_params[strategy]``, ``base`` its ``base_model``); ``params`` holds the strategy's typed
parameters (its ``Params`` in :mod:`symfuse.merge.registry`), the same as the ``merge`` command's flags. Relative
paths are read from the current folder, as the flags are. Example::

    strategy: regmean
    models: [ft/isear, ft/meld]
    stats: [stats/isear, stats/meld]
    weights: [1, 2]
    params: {alpha: 0.9}

mergekit's YAML is read as it is (a document with ``merge_method``): :mod:`symfuse.mergekit_config` translates it to
these fields, or refuses what symfuse cannot merge yet in one line naming the key.

This module imports only pydantic and yaml: a bad file (unknown strategy or key) fails before torch is imported; the
parameters are checked against the strategy's ``Params`` by the command, once the strategy is known.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, PrivateAttr, ValidationError, field_validator

from symfuse import yaml_io
from symfuse.config import _Strict
from symfuse.errors import UsageError
from symfuse.merge.registry import MERGERS, OUT_DTYPE_NAMES
from symfuse.mergekit_config import is_mergekit, translate

log = logging.getLogger(__name__)


class MergeFile(_Strict):
    """One merge: which models, with which strategy and parameters (the output folder is given on the command line)."""

    strategy: str = Field(description="Merge strategy (a name of symfuse.merge.registry.MERGERS).")
    models: list[str] = Field(min_length=2, description="Checkpoints to merge (two or more).")
    stats: list[str] | None = Field(default=None, description="One statistics folder (or file) per model, in order.")
    base: str | None = Field(default=None, description="Base checkpoint (task-vector strategies).")
    weights: list[float] | None = Field(default=None, description="One weight per model (>= 0, positive sum).")
    params: dict[str, Any] = Field(default_factory=dict, description="The strategy's parameters {name: value}.")
    device: str = Field(
        default="auto",
        pattern=r"^(auto|cpu|cuda(:\d+)?)$",
        description="Where the merge runs: auto (CUDA when torch sees a GPU), cpu, cuda or cuda:N (--device wins).",
    )
    out_dtype: Literal[OUT_DTYPE_NAMES] | None = Field(  # type: ignore[valid-type]
        default=None,
        description="Write the merged tensors in float32, float16, bfloat16 or float64 (default: the first model's "
        "dtype; --out-dtype wins).",
    )
    head_refit: dict[str, Any] | None = Field(
        default=None,
        description="Refit each head to the merged body: {data: [one dataset per model], ridge: 0.1, max_examples: "
        "256, device: cpu, ...} (symfuse.merge.head_refit.RefitOptions).",
    )

    allow_label_mismatch: bool = Field(
        default=False,
        description="Accept data (head_refit.data, params.data of regmean++) sharing no class with its model's head.",
    )

    _keys: dict[str, str] = PrivateAttr(default_factory=dict)  # parameter -> its key in a mergekit file

    @field_validator("strategy")
    @classmethod
    def _strategy(cls, value: str) -> str:
        MERGERS.require([value])
        return value

    def key_of(self, param: str) -> str:
        """How the file names ``param`` in messages: ``params.<name>``, or its mergekit key (``parameters.lambda``)."""
        return self._keys.get(param, f"params.{param}")


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
        data: Any = yaml_io.read_file(path)
    except ValueError as exc:  # names the file, line and column
        raise UsageError(str(exc)) from exc
    if not isinstance(data, dict):
        raise UsageError(
            f"{path}: expected a mapping (strategy:, models:, ...), got {type(data).__name__} — see README"
        )
    keys: dict[str, str] = {}
    mergekit = is_mergekit(data)
    if mergekit:
        found = translate(data, path)
        for note in found.notes:
            log.info("%s: %s", path, note)
        data, keys = found.data, found.labels
    try:
        mf = MergeFile.model_validate(data)
    except ValidationError as exc:
        # a misspelt key first: it is why the right one is missing
        e = sorted(exc.errors(), key=lambda e: e["type"] != "extra_forbidden")[0]
        key = ".".join(map(str, e["loc"])) or "(top level)"
        if mergekit:  # name the key as the file wrote it
            loc = [str(x) for x in e["loc"]]
            key = {"base": "base_model"}.get(key, keys.get(loc[-1], keys.get(loc[0], key)))
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            fix = f"remove it or fix its spelling (keys: {', '.join(MergeFile.model_fields)})"
        elif e["type"] == "missing":
            fix = "add it"
        elif e["type"] == "value_error":
            raise UsageError(f"{path}: {key}: {msg}") from exc  # the message names its fix
        else:
            fix = "fix its value"
        raise UsageError(f"{path}: {key}: {msg} — {fix}") from exc
    mf._keys = keys
    return mf
