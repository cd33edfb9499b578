"""Cheap checks of option values, run by every command before any work (each raises :class:`UsageError`)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from typer.core import TyperCommand

from symfuse.errors import DataError, SymfuseError, UsageError
from symfuse.seeds import seed_problem
from symfuse.symmetry.registry import Capability, check_kinds, kind_names  # no torch


def positive(option: str, value: float | None, what: str = "a number") -> None:
    """``value`` > 0 (None passes: the option was not given)."""
    if value is not None and not (math.isfinite(value) and value > 0):
        why = "is not positive" if math.isfinite(value) else "is not a finite number"
        raise UsageError(f"{option}: {value} {why} — give {what} > 0")


def at_least(option: str, value: int | None, low: int) -> None:
    """``value`` >= ``low`` (None passes)."""
    if value is not None and value < low:
        raise UsageError(f"{option}: {value} is below {low} — give an integer >= {low}")


def at_most(option: str, value: float | None, high: float, example: str) -> None:
    """``value`` <= ``high`` (None passes); ``example`` is a usual value, shown in the fix."""
    if value is not None and value > high:
        shown = f"{value:g}" if isinstance(value, float) else value
        raise UsageError(f"{option}: {shown} is above {high:g} — give at most {high:g}, e.g. {example}")


def fraction(option: str, value: float | None, closed_low: bool = False) -> None:
    """``value`` in (0, 1], or [0, 1] with ``closed_low`` (None passes)."""
    if value is None:
        return
    low_ok = value >= 0 if closed_low else value > 0
    if not (math.isfinite(value) and low_ok and value <= 1):
        interval = "[0, 1]" if closed_low else "(0, 1]"
        raise UsageError(f"{option}: {value} is outside {interval} — give a fraction such as 0.2")


def finite(option: str, value: float | None) -> None:
    """``value`` is a finite number (None passes)."""
    if value is not None and not math.isfinite(value):
        raise UsageError(f"{option}: {value} is not a finite number — give a real number")


def seed(option: str, value: int | None) -> None:
    """``value`` is a seed every generator takes, 0 .. 2^63 - 1 (None passes)."""
    problem = seed_problem(value) if value is not None else None
    if problem:
        raise UsageError(f"{option}: {problem}")


def one_of(option: str, value: str | None, choices: Iterable[str]) -> None:
    """``value`` is one of ``choices`` (None passes)."""
    choices = sorted(choices)
    if value is not None and value not in choices:
        raise UsageError(f"{option}: unknown value {value!r} — choose from {', '.join(choices)}")


def names_list(option: str, value: str, choices: Iterable[str], what: str = "names") -> list[str]:
    """A non-empty comma-separated list of known, distinct names (``what`` names them in messages)."""
    choices = list(choices)
    names = [s.strip() for s in value.split(",")]
    if not any(names):
        raise UsageError(f"{option}: {value!r} names nothing — give a comma-separated list of {', '.join(choices)}")
    if not all(names):
        raise UsageError(f"{option}: {value!r} has an empty item — remove the stray comma")
    unknown = [n for n in names if n not in choices]
    if unknown:
        raise UsageError(f"{option}: unknown {what} {', '.join(map(repr, unknown))} — choose from {', '.join(choices)}")
    if len(set(names)) != len(names):
        raise UsageError(f"{option}: {value!r} repeats a name — give each once")
    return names


def kinds(option: str, value: str, capability: Capability, what: str = "symmetries") -> list[str]:
    """Comma-separated registered symmetry kinds offering ``capability`` (weights, activations, draw), compatible."""
    names = names_list(option, value, kind_names(capability), what)
    try:
        check_kinds(names, capability)
    except ValueError as exc:  # kinds that exclude each other
        raise UsageError(f"{option}: {exc}") from exc
    return names


def local_path(option: str, value: str | Path, folder: bool = True) -> None:
    """A path that looks local (absolute, ``./``, or existing) must exist (a folder or a .gguf file when ``folder``).

    Model and dataset arguments also take hub ids (``owner/name``) and shared names; those pass here and are
    checked where they are resolved.
    """
    text = str(value)
    if "://" in text:
        raise UsageError(
            f"{option}: {text} is a URL — the command line reads local folders and hub ids; copy it to a local "
            "folder first (the pipeline reads and writes stores at any fsspec URL)"
        )
    path = Path(text)
    looks_local = path.exists() or text.startswith(("/", "./", "../", "~")) or text.count("/") > 1
    if not looks_local:
        return
    if not path.exists() and path.is_symlink():
        raise UsageError(f"{option}: {text} is a symbolic link that leads nowhere (or into a loop) — check the link")
    if not path.exists():
        raise UsageError(f"{option}: {text} does not exist — check the path")
    if folder and not path.is_dir() and path.suffix.lower() != ".gguf":  # a .gguf file is read as a checkpoint
        raise UsageError(f"{option}: {text} is a file, not a folder — give a folder (or a .gguf file)")


def distinct(option: str, values: Sequence[str | Path], what: str, weighted: bool = True) -> None:
    """No two of ``values`` name one file or folder (``--models a ./a`` would merge ``a`` with itself).

    ``weighted``: the command takes weights (the fix then says how to weight one model more).
    """
    seen = [_resolved(v) for v in values]
    for i, value in enumerate(values):
        twin = next((v for v, where in zip(values[:i], seen, strict=False) if where == seen[i]), None)
        if twin is not None:
            same = "" if str(twin) == str(value) else f" (as {twin} and {value})"
            how = " (--weights weights one more than another)" if weighted else ""
            raise UsageError(f"{option}: {value} given twice{same} — give each {what} once{how}")


def same_path(a: str | Path, b: str | Path) -> bool:
    """Whether ``a`` and ``b`` name one file or folder (``a``, ``./a/``, a link to it)."""
    return _resolved(a) == _resolved(b)


def _resolved(value: str | Path) -> Path:
    try:
        return Path(value).resolve()
    except (OSError, RuntimeError):  # a symbolic-link loop: named by the path checks
        return Path(value).absolute()


class MultiValueCommand(TyperCommand):
    """A command whose ``list`` options take several space-separated values: ``--models A B C``.

    click options take one value per flag, so the arguments are rewritten to ``--models A --models B ...``
    before parsing; the options stay ordinary, documented options (``--help`` lists them).
    """

    multi_value: Sequence[str] = ()

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        """Expand ``--opt v1 v2 ...`` for the multi-value options, then parse as usual."""
        expanded: list[str] = []
        flag: str | None = None
        for a in args:
            if a.startswith("-") and not _is_number(a):
                flag = a if a in self.multi_value else None
                if flag is None:
                    expanded.append(a)
            elif flag is not None:
                expanded += [flag, a]
            else:
                expanded.append(a)
        return super().parse_args(ctx, expanded)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def multi_value_command(*options: str) -> type[MultiValueCommand]:
    """A :class:`MultiValueCommand` subclass whose ``options`` take several values."""
    return type("MultiValue", (MultiValueCommand,), {"multi_value": tuple(options)})


DEVICE_HELP = "Where the maths runs: auto (CUDA when torch sees a GPU, else the CPU), cpu, cuda or cuda:N."


def device(option: str, value: str) -> str:
    """The device ``value`` names on this machine (``cpu`` / ``cuda:N``); a device that is not there is refused.

    Raises:
        DeviceError: (a UsageError, exit 2) not a device, or not on this machine.
    """
    from symfuse.device import resolve_device

    return str(resolve_device(value, option))


def scored_dataset(option: str, value: str, split: str) -> bool:
    """Check the data a model is scored on, before any model is loaded; True for a language-modelling dataset.

    A language-modelling dataset (causal LMs' next-token loss) has its split and records read; any other is loaded
    as a task dataset (:func:`dataset`).
    """
    from symfuse.data.text import is_language_modeling, text_split

    if is_language_modeling(value):
        text_split(value, split)
        return True
    dataset(option, value, split)
    return False


def head_reads(option: str, value: str, model: str | Path) -> None:
    """Refuse a dataset whose task ``model``'s head cannot score (a regression set on a classifier, ...)."""
    from symfuse.preflight import head_task_problem

    if problem := head_task_problem(model, value):
        raise UsageError(f"{option} {value}: {problem}")


def dataset(option: str, value: str, split: str | None = None, texts: bool = False) -> None:
    """Load the dataset once (cached): a bad name or file, or a missing ``split``, fails before any model loads.

    ``texts``: the command reads the texts only (activations), so a language-modelling dataset is taken too.
    """
    from symfuse.data import load_task_dataset
    from symfuse.data.text import is_language_modeling, text_split

    if texts and is_language_modeling(value):
        text_split(value, split or "train", max_examples=1)
        return
    ds = load_task_dataset(value)
    if split is not None:
        ds.split(split)


def writable_file(option: str, value: Path | None) -> None:
    """The folder ``value`` is written into can be written by this user (None passes).

    A file output is written last, after the work: a folder this user cannot write failed only then, naming a
    hidden temporary file.
    """
    if value is None:
        return
    from symfuse.io.modes import can_create_in, creation_refused, nearest_existing

    folder = nearest_existing(Path(value).absolute().parent)
    if not folder.is_dir():  # found only when the file was written, after the work
        raise UsageError(f"{option}: {value}: {folder} is a file, not a folder — choose another {option}")
    if not can_create_in(folder):
        raise UsageError(
            f"{option}: {value}: its folder {folder} is not writable by this user — choose another {option}"
        )
    if why := creation_refused(folder):  # permissions may say yes where the file system says no
        raise UsageError(f"{option}: {value}: no file can be created in {folder} ({why}) — choose another {option}")


def metrics_file(option: str, value: Path | None) -> None:
    """``value`` is a new file, or a metrics JSON an earlier ``evaluate`` wrote (None passes).

    A metrics file is replaced on each run; any other existing file (a model's config or weights, a dataset) is not.
    """
    if value is None or not value.exists():
        return
    if value.is_dir():
        raise UsageError(f"{option}: {value} is a folder — give the metrics JSON file to write")
    import json

    try:
        found = json.loads(value.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        found = None
    if not (isinstance(found, dict) and {"dataset", "split", "model"} <= found.keys()):
        raise UsageError(
            f"{option}: {value} exists and is not a metrics file of symfuse evaluate — it would be replaced; "
            "choose another file"
        )


def _unreadable(what: str, value: str | Path, exc: BaseException, fix: str) -> DataError:
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return DataError(f"{value}: unreadable {what} ({type(exc).__name__}: {first}) — {fix}")


def checkpoint(value: str | Path, arch: bool = True) -> None:
    """Open a checkpoint's config and safetensors headers (no tensor data): a bad folder fails before any work.

    Args:
        value: Folder, ``minilm`` or hub id.
        arch: Also resolve its architecture spec (commands that match or merge by module).

    Raises:
        DataError: the folder cannot be read (its own error names it otherwise).
    """
    from safetensors import safe_open

    from symfuse.checkpoint import CheckpointReader, resolve_checkpoint
    from symfuse.io.modes import check_readable

    fix = "re-save it with save_pretrained(safe_serialization=True)"
    try:
        if arch:
            with CheckpointReader(value):
                return
        folder = resolve_checkpoint(value)
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise DataError(f"{value}: no *.safetensors weights — {fix}")
        for file in files:
            check_readable(file)  # safe_open says "No such file or directory" for a file it may not read
            with safe_open(str(file), "pt") as f:
                f.keys()
    except SymfuseError:
        raise
    except Exception as exc:
        raise _unreadable("checkpoint", value, exc, fix) from exc


def stats_files(values: Sequence[str | Path], kinds: Iterable[str]) -> None:
    """Open the header of each statistics file a merge will read (one folder or file per model).

    Raises:
        UsageError: a folder without a needed kind, or files of another kind (the files and their kinds named).
        DataError: an unreadable file.
    """
    from symfuse.stats.io import STAT_KINDS, StatsFile

    kinds = sorted(kinds)
    fix = f"collect them with `symfuse stats MODEL --data DATA --kind {','.join(kinds)} --out DIR` and give DIR"
    held: dict[str, str] = {}
    for value in values:
        path = Path(value)
        if path.is_dir():
            have = [k for k in STAT_KINDS if (path / f"{k}.safetensors").is_file()]
            lacking = [k for k in kinds if k not in have]
            if lacking:
                holds = f"holds {', '.join(have)} statistics" if have else "holds no statistics file"
                raise UsageError(f"--stats: {path} {holds}, not {', '.join(lacking)} — {fix}")
        for file in [path / f"{k}.safetensors" for k in kinds] if path.is_dir() else [path]:
            try:
                sf = StatsFile(file)
            except SymfuseError:
                raise
            except Exception as exc:
                raise _unreadable("statistics file", file, exc, "collect it again with `symfuse stats`") from exc
            if not path.is_dir():
                held[str(file)] = sf.kind or "unknown"
    wrong = {f: k for f, k in held.items() if k not in kinds}
    if wrong and len(kinds) == 1:  # several kinds come as one file per kind and model (the merge pairs them)
        given = ", ".join(f"{f} ({k})" for f, k in wrong.items())
        raise UsageError(f"--stats: {given}: not {kinds[0]} statistics — {fix}")
