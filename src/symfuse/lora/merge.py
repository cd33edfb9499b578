"""``merge_adapters``: merge K LoRA / DoRA adapters of one base into one adapter, or into the base.

Per adapted module, the K updates ``D_i = s_i B_i A_i`` are merged by a registered strategy in one of the
:mod:`symfuse.lora.bases` bases (``aligned``: KnOTS's shared SVD basis, the default; ``full``: the updates
themselves; ``naive``: the factors separately, as PEFT's ``add_weighted_adapter``). A module that an adapter does
not adapt counts as a zero update of that adapter.

Output:

* an adapter folder (default): plain LoRA (``use_rslora`` false, ``lora_alpha = r``: scale 1) of rank ``r`` (default
  the largest sum over the adapters of a module's ranks, which holds any ``aligned`` merge and any linear one
  exactly), ``B A`` the best rank-``r`` approximation of the merged update (the report states each module's
  relative Frobenius truncation error); DoRA inputs give a DoRA adapter;
* with ``into_base``: the base checkpoint with every adapted weight replaced (``W + D``; DoRA: the formula below),
  no truncation.

DoRA (PEFT's definition, the norm of each output row of an ``nn.Linear`` weight): adapter ``i``'s weight is
``W_i = m_i * (W + D_i) / ||W + D_i||``. Its magnitude's change is ``dm_i = m_i - ||W||`` (PEFT starts ``m`` at
``||W||``), and the merge is::

    D = strategy(D_i)  (in the chosen basis)        m = ||W|| + strategy(dm_i)        W' = m * (W + D) / ||W + D||

so one adapter with weight 1 (a strategy that returns a single input unchanged) gives back ``W_1`` exactly.
``||W||`` needs the base weights: DoRA merges need ``base``. Adapters of one kind only (all DoRA or none).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from symfuse.checkpoint import CheckpointReader, resolve_checkpoint, write_checkpoint
from symfuse.config_json import read_config_json
from symfuse.device import resolve_device
from symfuse.errors import CheckpointError, UsageError
from symfuse.lora import heads
from symfuse.lora.adapter import LoraAdapter, LoraModule, read_adapter, write_adapter
from symfuse.lora.bases import BASES, F64, combine, low_rank, merge_aligned, merge_full, merge_naive
from symfuse.lora.report import adapter_config, write_report
from symfuse.merge.base import Merger
from symfuse.merge.registry import MERGERS
from symfuse.outputs import atomic_output_dir, check_output

log = logging.getLogger(__name__)

_MERGE = {"aligned": merge_aligned, "full": merge_full, "naive": merge_naive}


def make_merger(strategy: str, k: int, params: Mapping[str, Any]) -> Merger:
    """The strategy's merger for ``k`` adapters, refused when it needs what adapters do not have.

    One adapter is accepted by every strategy that takes any number of models (a merge of one, e.g. to re-factor
    or rescale it).

    Raises:
        UsageError: unknown strategy, statistics or data it needs, a model count it does not merge.
        ValueError: a bad parameter (one line naming it).
    """
    MERGERS.require([strategy])
    cls = MERGERS[strategy]
    if cls.required_stats or getattr(cls, "needs_data", False):
        need = ", ".join(sorted(cls.required_stats)) or "each model's data"
        raise UsageError(
            f"--strategy: {strategy} reads {need} of full models — adapters have none; choose a strategy without "
            "statistics (simple, task-arithmetic, ties, dare, ...)"
        )
    if not (k == 1 and cls.model_count[1] is None):
        try:
            cls.check_model_count(k)
        except UsageError as exc:
            raise UsageError(str(exc).replace("--models", "--adapters")) from None
    return cls(**params)


def _check_inputs(adapters: Sequence[LoraAdapter]) -> None:
    """One base (its name, model class, task and layer stacks, where known), one kind (DoRA or not), one shape each."""
    first = adapters[0]
    for ad in adapters[1:]:
        if ad.base and first.base and not _same_base(ad.base, first.base):
            raise CheckpointError(
                f"{ad.path}: adapter of base {ad.base}, but {first.path} adapts {first.base} — merge adapters of one "
                "base model (or fix base_model_name_or_path in adapter_config.json if it is the same model)"
            )
        for what, mine, theirs in (("base model class", _model_class(ad), _model_class(first)),
                                   ("task_type", ad.config.get("task_type"), first.config.get("task_type")),
                                   ("stack of layers", _layer_stacks(ad), _layer_stacks(first))):  # fmt: skip
            if mine and theirs and (not mine & theirs if isinstance(mine, set) else mine != theirs):
                raise CheckpointError(f"{ad.path}: {what} {_shown(mine)}, but {first.path} has {_shown(theirs)} — "
                                      "merge adapters of one base model")  # fmt: skip
        if ad.dora != first.dora:
            raise CheckpointError(
                f"{ad.path}: use_dora is {ad.dora}, {first.path} has {first.dora} — merge DoRA adapters only with "
                "DoRA adapters"
            )
    shapes: dict[str, tuple[tuple[int, int], Path]] = {}
    for ad in adapters:
        for key, m in ad.modules.items():
            shape = (int(m.B.shape[0]), int(m.A.shape[1]))
            seen = shapes.setdefault(key, (shape, ad.path))
            if seen[0] != shape:
                raise CheckpointError(
                    f"{ad.path}: {key} updates a {shape} weight, {seen[1]} a {seen[0]} one — adapters of one base"
                )


def _same_base(a: str, b: str) -> bool:
    """Whether two ``base_model_name_or_path`` name one model (one folder however spelt, else the same name)."""
    if os.path.isdir(a) and os.path.isdir(b):
        return os.path.realpath(a) == os.path.realpath(b)
    return a.rstrip("/") == b.rstrip("/")


def _model_class(ad: LoraAdapter) -> str | None:
    """The base's model class PEFT recorded (``auto_mapping.base_model_class``), if any."""
    mapping = ad.config.get("auto_mapping")
    return mapping.get("base_model_class") if isinstance(mapping, Mapping) else None


def _layer_stacks(ad: LoraAdapter) -> set[str]:
    """Where the adapted layers sit (``model.layers``, ``transformer.h``): a module path up to its layer index."""
    stacks = set()
    for key in ad.modules:
        parts = key.split(".")
        index = next((i for i, p in enumerate(parts) if p.isdigit()), None)
        if index:
            stacks.add(".".join(parts[:index]))
    return stacks


def _shown(value: object) -> str:
    return ", ".join(sorted(value)) if isinstance(value, set) else str(value)


def _check_base(adapters: Sequence[LoraAdapter], base: str | os.PathLike) -> None:
    """Refuse a ``base`` other than the local folder the adapters name; warn when a hub id they name does not match.

    A ``base_model_name_or_path`` that is an existing folder must resolve to ``base``'s folder. Any other name (a hub
    id, or a folder of another machine) matches when its last component is ``base``'s folder name or the last
    component of its ``config.json`` ``_name_or_path``; hub copies are often renamed, so a mismatch only warns.

    Raises:
        CheckpointError: the adapters name an existing local folder that is not ``base``.
    """
    ad = next((a for a in adapters if a.base), None)
    if ad is None:
        return
    named, given = Path(str(ad.base)).expanduser(), resolve_checkpoint(base).resolve()  # an alias: its folder
    if named.is_dir():
        if named.resolve() != given:
            raise CheckpointError(
                f"{ad.path}: adapter of base {named.resolve()}, but --base is {given} — pass --base {ad.base}, or edit "
                "base_model_name_or_path in adapter_config.json if that base was moved or copied"
            )
        return
    last = str(ad.base).rstrip("/").rsplit("/", 1)[-1].casefold()
    try:
        saved = str(read_config_json(given).get("_name_or_path") or "")
    except CheckpointError:
        saved = ""
    if last not in {given.name.casefold(), saved.rstrip("/").rsplit("/", 1)[-1].casefold()}:
        log.warning(
            "%s: adapter of base %s, but --base %s is neither named so nor saved from it (config.json _name_or_path "
            "%r) — check that it is the model the adapters were trained on",
            ad.path,
            ad.base,
            given,
            saved,
        )


def _module_keys(adapters: Sequence[LoraAdapter]) -> list[str]:
    """Every adapted module, in the first adapter's order, then the others' new ones."""
    keys: dict[str, None] = {}
    for ad in adapters:
        keys.update(dict.fromkeys(ad.modules))
    return list(keys)


def _factors(
    adapters: Sequence[LoraAdapter], key: str, basis: str, device: torch.device
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The K ``(B_i, A_i)`` of ``key`` on ``device``, the scale folded in (naive: ``sqrt(s)`` each); 0 where absent."""
    present = [ad.modules[key] for ad in adapters if key in ad.modules]
    out_dim, in_dim = int(present[0].B.shape[0]), int(present[0].A.shape[1])
    rank = present[0].rank if basis == "naive" else 0
    bs, as_ = [], []
    for ad in adapters:
        m: LoraModule | None = ad.modules.get(key)
        if m is None:
            bs.append(torch.zeros(out_dim, rank, dtype=F64, device=device))
            as_.append(torch.zeros(rank, in_dim, dtype=F64, device=device))
        elif basis == "naive":
            root = m.scale**0.5
            bs.append(root * m.B.to(device, F64))
            as_.append(root * m.A.to(device, F64))
        else:
            bs.append(m.scale * m.B.to(device, F64))
            as_.append(m.A.to(device, F64))
    return bs, as_


def _check_naive_ranks(adapters: Sequence[LoraAdapter]) -> None:
    ranks = {m.rank for ad in adapters for m in ad.modules.values()}
    if len(ranks) > 1:
        raise UsageError(
            f"--basis naive: the adapters' ranks differ ({sorted(ranks)}) — naive merges factors entrywise and needs "
            "one rank; use --basis aligned or full"
        )


class _Base:
    """The base checkpoint's weights of the adapted modules, as ``(out, in)``, and their row norms (DoRA).

    A weight is stored ``(in, out)`` where the base's layer is a GPT-2 style ``Conv1D``: the attention and FFN
    weights of a ``conv1d`` family (:meth:`transposed`). PEFT decides so per layer from the layer's type (it sets
    ``fan_in_fan_out`` for a ``Conv1D`` and clears it for an ``nn.Linear``, whatever the config says), so the
    config's one flag is not read here: a GPT-2 classifier's adapter of ``attn.c_proj`` and ``score`` holds both.

    A layer tied to another is stored once (:func:`~symfuse.lora.heads.tied_weights`): :meth:`stored` names it.
    """

    def __init__(self, base: str | os.PathLike):
        self.reader = CheckpointReader(base)
        self.names = set(self.reader.names())
        self.conv1d = set(self.reader.tensor_owners()) if self.reader.spec.conv1d else set()
        self.ties = heads.tied_weights(self.reader.config, self.names)
        self.embeddings: set[str] = set()  # adapted embeddings (stored (vocab, dim), transposed as a Conv1D)

    def stored(self, name: str) -> str:
        """The stored tensor that holds base tensor ``name`` (a tied ``lm_head.weight``: the input embedding)."""
        return self.ties.get(name, name)

    def transposed(self, key: str) -> bool:
        """Whether module ``key``'s weight is stored ``(in, out)`` (a ``Conv1D``, an embedding)."""
        return f"{key}.weight" in self.conv1d or key in self.embeddings

    def check(self, key: str, shape: tuple[int, int]) -> None:
        """Refuse a base without module ``key``'s weight of ``shape`` (``(out, in)``)."""
        name = self.stored(f"{key}.weight")
        if name not in self.names and name.partition(".")[2] in self.names:  # a bare body, the adapter's task model
            raise CheckpointError(
                f"{self.reader.path}: stores the bare model ({name.partition('.')[2]}), the adapters its task model "
                f"({name}) — save the base as the model they were trained on (e.g. AutoModelForSequenceClassification"
                ".from_pretrained(BASE, num_labels=N).save_pretrained(DIR)) and give --base DIR"
            )
        if name not in self.names:
            raise CheckpointError(
                f"{self.reader.path}: has no {name}, which the adapters update — give the base model they were "
                "trained on"
            )
        have, stored = tuple(self.reader.shape(name)), shape[::-1] if self.transposed(key) else shape
        if have != stored:
            raise CheckpointError(
                f"{self.reader.path}: {name} is {have}, the adapters update a {stored} weight — give the base model "
                "they were trained on"
            )

    def weight(self, key: str, device: torch.device | str = "cpu") -> torch.Tensor:
        """``W`` of module ``key`` as ``(out, in)`` float64 on ``device``."""
        w = self.reader.get(self.stored(f"{key}.weight")).to(device, F64)
        return w.T if self.transposed(key) else w


def _embeddings(adapters: Sequence[LoraAdapter]) -> set[str]:
    """The adapted modules that are embeddings."""
    return {k for ad in adapters for k, m in ad.modules.items() if m.embedding}


def _row_norm(w: torch.Tensor) -> torch.Tensor:
    return torch.linalg.norm(w, dim=1)


def merge_adapters(
    adapters: Sequence[str | os.PathLike],
    out: str | os.PathLike,
    strategy: str,
    basis: str = "aligned",
    rank: int | None = None,
    base: str | os.PathLike | None = None,
    into_base: bool = False,
    overwrite: bool = False,
    device: str | torch.device = "cpu",
    **params: Any,
) -> Path:
    """Merge K LoRA adapters of one base into one adapter folder (or, ``into_base``, a full checkpoint).

    Args:
        adapters: K PEFT adapter folders (``adapter_config.json`` + ``adapter_model.safetensors``).
        out: Output folder (written atomically, with ``symfuse_report.json``).
        strategy: A registered strategy without statistics (``simple``, ``task-arithmetic``, ``ties``, ...).
        basis: ``aligned`` | ``full`` | ``naive`` (see :mod:`symfuse.lora.bases`).
        rank: The output adapter's rank (default: the largest sum of a module's ranks; naive: the adapters' rank).
        base: The base checkpoint (needed for DoRA and ``into_base``).
        into_base: Write the base with the merged updates applied instead of an adapter.
        overwrite: Replace an existing ``out``.
        device: Where the bases, SVDs and the strategy run (``cpu``, ``cuda``, ``cuda:N``, ``auto``; one module at a
            time on it); what is written comes back to the CPU.
        **params: The strategy's parameters (``weights=[...]``, ``density=0.2``, ``lam=1.0``, ...).

    Returns:
        ``out``.

    Raises:
        CheckpointError: a bad adapter, adapters of different bases or kinds, a ``base`` other than the local folder
            the adapters name, a base without the adapted weights.
        UsageError: a strategy that needs statistics, a missing ``base``, a bad ``basis`` / ``rank``.
    """
    with contextlib.ExitStack() as scratch:  # a bare base's classifier, built for the merge (heads.task_base)
        return _merge(adapters, out, strategy, basis, rank, base, into_base, overwrite, device, scratch, **params)


def _merge(
    adapters: Sequence[str | os.PathLike], out: str | os.PathLike, strategy: str, basis: str, rank: int | None,
    base: str | os.PathLike | None, into_base: bool, overwrite: bool, device: str | torch.device,
    scratch: contextlib.ExitStack, **params: Any,
) -> Path:  # fmt: skip
    start = time.perf_counter()
    dev = resolve_device(device)
    if basis not in BASES:
        raise UsageError(f"--basis: unknown value {basis!r} — choose from {', '.join(BASES)}")
    if rank is not None and (into_base or rank < 1):
        raise UsageError(f"--rank: {rank} — give a rank >= 1 for an adapter output (none with --into-base)")
    check_output(out, overwrite, inputs=[*adapters, base])
    ads = [read_adapter(a) for a in adapters]
    merger = make_merger(strategy, len(ads), params)
    if len(ads) == 1 and [float(w) for w in params.get("weights") or [1.0]] != [1.0]:  # normalised: it was ignored
        raise UsageError("--weights: one adapter — weights are normalised to sum to 1, so one weight changes nothing; "
                         "scale its update with --strategy task-arithmetic --lam VALUE")  # fmt: skip
    merger.device = dev
    weights = merger.model_weights(len(ads))
    _check_inputs(ads)
    if base is not None:
        _check_base(ads, base)
    if basis == "naive":
        _check_naive_ranks(ads)
    dora = ads[0].dora
    if (dora or into_base) and base is None:
        why = "DoRA magnitudes are relative to the base's row norms" if dora else "--into-base writes the base"
        raise UsageError(f"--base: missing — {why}; give the base checkpoint with --base BASE")
    keys = _module_keys(ads)
    sums = [sum(ad.modules[k].rank for ad in ads if k in ad.modules) for k in keys]
    widest = max(min(m.B.shape[0], m.A.shape[1]) for ad in ads for m in ad.modules.values())
    if rank is not None and rank > widest:  # the rest is zero padding (10^6 wrote 1.5 GB for 32-wide modules)
        raise UsageError(f"--rank: {rank} is above {widest}, the largest rank an update of these modules can have "
                         f"(min(out, in) of the largest weight) — give at most {widest}")  # fmt: skip
    out_rank = rank or (ads[0].modules[keys[0]].rank if basis == "naive" else max(sums))
    built = heads.task_base(resolve_checkpoint(base), ads, scratch, into_base) if base is not None else None
    bw = _Base(built or base) if base is not None else None
    if bw is not None:
        bw.embeddings = _embeddings(ads)
    for key in keys if bw is not None else ():
        m = next(ad.modules[key] for ad in ads if key in ad.modules)
        bw.check(key, (int(m.B.shape[0]), int(m.A.shape[1])))
    heads.check_saved_base(ads, bw)
    heads.check_heads(ads, {n: tuple(bw.reader.shape(bw.stored(n))) for n in bw.names | set(bw.ties)} if bw else None)
    if (body := [n for n in ads[0].saved_modules if not heads.is_head(n)]) and bw is None:
        raise UsageError(f"--base: missing — {ads[0].path} trains {body[0]} whole (modules_to_save), a body layer that "
                         "merges as a task vector of the base's; give the base with --base BASE")  # fmt: skip
    tied = [n for n in ads[0].saved_modules if bw and (n in bw.ties or n in bw.ties.values())]
    if into_base and tied:  # PEFT's wrapper unties them on the base
        log.warning("%s: trains %s whole, which the base ties to another layer: the merged model keeps them tied, so "
                    "that layer becomes the trained one too (the adapter on the base keeps it)", ads[0].path,
                    tied[0])  # fmt: skip
    job = _Job(ads, basis, merger, weights, bw, dev)
    if not into_base and len({ad.dtype for ad in ads}) > 1:
        stored = ", ".join(f"{ad.path} {str(ad.dtype).removeprefix('torch.')}" for ad in ads)
        log.warning("adapters stored in different dtypes (%s): the merged adapter is written in %s", stored, job.dtype)
    folders = heads.head_folders(ads)
    with atomic_output_dir(out, overwrite=overwrite) as tmp:
        if into_base:
            errors: dict[str, float] = {}
            _write_into_base(job, keys, tmp, folders)
        else:
            errors = _write_adapter(job, out_rank, keys, tmp, folders)
        write_report(tmp, strategy, merger, basis, ads, weights, base, into_base, out_rank, errors, start, folders)
    log.info("merged %d adapter(s) with %s (%s basis) into %s", len(ads), strategy, basis, out)
    return Path(out)


@dataclass(frozen=True)
class _Job:
    """What merging one module needs: the adapters, the basis, the strategy and its weights, the base."""

    ads: Sequence[LoraAdapter]
    basis: str
    merger: Merger
    weights: Sequence[float]
    bw: _Base | None
    device: torch.device

    @property
    def dtype(self) -> torch.dtype:
        """The merged adapter's dtype: one that holds every input's (fp16 and fp32 give fp32), in any order."""
        out = self.ads[0].dtype
        for ad in self.ads[1:]:
            out = torch.promote_types(out, ad.dtype)
        return out

    def bodies(self) -> dict[str, torch.Tensor]:
        """The body layers the adapters train whole, merged (in the stored dtype of the first's copy)."""
        saved = {n: t for n, t in self.ads[0].saved_modules.items() if not heads.is_head(n)}
        get = self.bw.reader.get if self.bw is not None else None
        return {n: heads.merged_body(self.ads, n, get(self.bw.stored(n)), self.merger, self.weights).to(t.dtype)
                for n, t in saved.items()} if get else {}  # fmt: skip

    def module(self, key: str) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """``(left, core, m)``: the merged update ``left @ core`` (``left`` None: the identity), DoRA's ``m``."""
        bs, as_ = _factors(self.ads, key, self.basis, self.device)
        left, core = _MERGE[self.basis](self.merger, key, bs, as_, self.weights)
        if not self.ads[0].dora:
            return left, core, None
        assert self.bw is not None
        norm = _row_norm(self.bw.weight(key, self.device))
        dms = []  # each magnitude's change from the base's row norms (none where an adapter leaves the module)
        for ad in self.ads:
            mag = ad.modules[key].magnitude if key in ad.modules else None
            dms.append(mag.to(self.device, F64) - norm if mag is not None else torch.zeros_like(norm))
        return left, core, norm + combine(self.merger, f"{key}.magnitude", dms, self.weights)


def _write_adapter(job: _Job, rank: int, keys: Sequence[str], tmp: Path, folders: Sequence[str]) -> dict[str, float]:
    """The merged adapter (rank ``rank``, scale 1), one module at a time; returns each module's truncation error.

    With saved heads (``folders``, see :mod:`symfuse.lora.heads`): the first adapter's head, and a copy of the merged
    adapter with each other adapter's head in its folder.
    """
    factors, errors = {}, {}
    for key in keys:
        left, core, mag = job.module(key)
        b, a, errors[key] = low_rank(left, core, rank)
        b, a = b.to(job.dtype), a.to(job.dtype)
        _finite((b.to(F64) @ a.to(F64)).to(b.dtype), key, job)  # the update PEFT adds (inf in b or a shows here)
        factors[key] = (b.cpu(), a.cpu(), mag.cpu() if mag is not None else None)
    config, bodies = adapter_config(job.ads, rank, keys), job.bodies()
    for ad, rel in zip(job.ads, folders or ["."], strict=False):
        (folder := tmp / rel).mkdir(parents=True, exist_ok=True)
        write_adapter(folder, config, factors, job.dtype, {**bodies, **heads.own_head(ad)}, _embeddings(job.ads))
    return errors


def _write_into_base(job: _Job, keys: Sequence[str], tmp: Path, folders: Sequence[str]) -> None:
    """The base checkpoint with ``W + D`` (DoRA: ``m (W + D) / ||W + D||``) for every adapted weight (streamed).

    With saved heads: the first adapter's head, and in each other adapter's folder the merged model with its head.
    """
    assert job.bw is not None
    bw, head, targets = job.bw, heads.own_head(job.ads[0]), {}
    bodies = {bw.stored(n): t for n, t in job.bodies().items()}  # a tied layer's goes where it is stored
    for key in keys:  # a tied head and its embedding are one stored tensor: both updates go there
        targets.setdefault(bw.stored(f"{key}.weight"), []).append(key)

    def replace(name: str, stored: torch.Tensor) -> torch.Tensor:
        if name in head or name in bodies:
            return {**bodies, **head}[name].to(stored.dtype)
        if name not in targets:
            return stored
        w = stored.to(job.device, F64)  # as stored; each update oriented so
        for key in targets.get(name, ()):
            left, core, mag = job.module(key)
            d = left @ core if left is not None else core
            if mag is not None:  # DoRA: the only update of its tensor (DoRA embeddings are refused)
                full = w.T + d if bw.transposed(key) else w + d
                full = (mag / _row_norm(full))[:, None] * full
                w = full.T if bw.transposed(key) else full
            else:
                w = w + (d.T if bw.transposed(key) else d)
        return _finite(w.to("cpu", stored.dtype), ", ".join(targets[name]), job).contiguous()

    write_checkpoint(bw.reader, tmp, replace=replace, overwrite=True)
    if len(folders) > 1:
        with CheckpointReader(tmp) as merged:
            for ad, rel in zip(job.ads[1:], folders[1:], strict=True):
                own = {n: t.to(merged.dtype(n)) for n, t in heads.own_head(ad).items()}
                write_checkpoint(merged, tmp / rel, replace=own)


def _finite(t: torch.Tensor, key: str, job: _Job) -> torch.Tensor:
    """``t``, or an error when the merged update of module ``key`` overflowed (inf / NaN): nothing is written."""
    if torch.isfinite(t).all():
        return t
    raise CheckpointError(
        f"{key}: the merged update holds inf / NaN in {t.dtype} — an adapter's scale (lora_alpha / r) or its "
        f"weights are too large ({', '.join(str(ad.path) for ad in job.ads)}); check the adapters' configs"
    )
