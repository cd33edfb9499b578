"""Run mergekit 0.1.5 on several YAML files in one process (for bench/mergekit_parity.py; never imports symfuse).

Usage: ``PYTHONPATH=bench/.mergekit-lib python bench/mergekit_driver.py SPEC OUT SEED INJECT [...]`` (quadruples),
with ``MK_INDEX`` a JSON ``{model path: index}``. Prints one ``RESULT<TAB>OUT<TAB>seconds<TAB>draws<TAB>error`` line
per merge.

``INJECT`` 1: the random sparsifiers draw symfuse's masks instead of torch's global generator. mergekit's
``torch.bernoulli(p)`` inside ``mergekit.sparsify`` becomes ``u >= 1 - p`` with ``u`` the uniform draws symfuse
makes for that tensor and model (``symfuse.merge.task_vectors.seeded_uniform``: a CPU generator seeded by
``seed * 1_000_003 + crc32(tensor name) * 31 + model index``, restated here), so DARE / DELLA are compared on the
same masks; ``draws`` counts the masks replaced.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import zlib

import mergekit.sparsify as sp
import torch
import yaml
from mergekit.config import MergeConfiguration
from mergekit.merge import run_merge
from mergekit.merge_methods import generalized_task_arithmetic as gta
from mergekit.options import MergeOptions

INDEX = json.loads(os.environ.get("MK_INDEX", "{}"))
STATE: dict = {"inject": False, "seed": 0, "u": None, "group": None, "i": 0, "draws": 0}


def seeded_uniform(shape: tuple[int, ...], seed: int, name: str, index: int) -> torch.Tensor:
    """symfuse's mask draws (see the module docstring)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()) * 31 + index)
    return torch.rand(shape, generator=g)


class _Torch:
    """``torch`` as mergekit.sparsify sees it: ``bernoulli`` reads the injected draws while there are some."""

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def bernoulli(p: torch.Tensor) -> torch.Tensor:
        u = STATE["u"]
        if u is None:
            return torch.bernoulli(p)
        STATE["draws"] += 1
        return (u.reshape(p.shape).double() >= 1 - p.double()).to(p.dtype)


_merge_group, _sparsify = gta.GeneralizedTaskArithmeticMerge.merge_group, gta.sparsify


def _merge_group_seen(self, group, /, **parameters):
    STATE["group"], STATE["i"] = group, 0
    return _merge_group(self, group, **parameters)


def _sparsify_injected(tensor, *args, **kwargs):
    group, i = STATE["group"], STATE["i"]
    STATE["i"] += 1
    if STATE["inject"]:
        index = INDEX[str(group.non_base[i].id.model.path)]
        STATE["u"] = seeded_uniform(tuple(tensor.shape), STATE["seed"], group.metadata.name, index)
    try:
        return _sparsify(tensor, *args, **kwargs)
    finally:
        STATE["u"] = None


sp.torch = _Torch()
gta.GeneralizedTaskArithmeticMerge.merge_group = _merge_group_seen
gta.sparsify = _sparsify_injected


def main(argv: list[str]) -> None:
    """Merge each ``SPEC OUT SEED INJECT`` quadruple; one RESULT line each."""
    for spec, out, seed, inject in zip(*[iter(argv)] * 4, strict=True):
        t0, err = time.perf_counter(), ""
        STATE.update(inject=inject == "1", seed=int(seed), draws=0)
        try:
            opts = MergeOptions(cuda=False, random_seed=int(seed), lazy_unpickle=False, quiet=True)
            opts.apply_global_options()  # seeds torch (transformers' set_seed), as mergekit-yaml --random-seed does
            with open(spec, encoding="utf-8") as f:
                config = MergeConfiguration.model_validate(yaml.safe_load(f))
            run_merge(config, out, options=opts)
        except Exception as exc:  # reported in the table, the other merges go on
            err = (traceback.format_exception_only(exc)[-1].strip() or repr(exc))[:160]
        print("RESULT", out, round(time.perf_counter() - t0, 2), STATE["draws"], err, sep="\t", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
