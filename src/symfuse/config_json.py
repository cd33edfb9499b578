"""A checkpoint's ``config.json``: read without transformers, and the one-line errors for what it gets wrong.

:func:`read_config_json` names the line and column of bad JSON; :func:`unknown_model_type` names the families
symfuse knows (and the closest one to a misspelling); :func:`config_error` turns what transformers raised into
one line naming the field's model type.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from symfuse.arch import supported_model_types
from symfuse.errors import CheckpointError, UnsupportedArchitecture
from symfuse.io.modes import not_readable


def read_config_json(folder: Path) -> dict[str, Any]:
    """A checkpoint folder's ``config.json`` as a dict (no transformers import).

    Raises:
        CheckpointError: the file is absent, not UTF-8 JSON (line and column named) or not a mapping.
    """
    file = Path(folder) / "config.json"
    fix = "fix or re-export it with save_pretrained"
    if file.exists() and not file.is_file():  # a pipe or device: reading it would wait forever
        raise CheckpointError(f"{file}: not a regular file — {fix}")
    try:
        data = json.loads(file.read_bytes().decode("utf-8"))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{file}:{exc.lineno}:{exc.colno}: not valid JSON ({exc.msg}) — {fix}") from exc
    except PermissionError as exc:
        raise not_readable(file) from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{file}: cannot be read ({type(exc).__name__}) — {fix}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{file}: expected a JSON object, got {type(data).__name__} — {fix}")
    return data


def update_config_json(folder: Path, updates: Mapping[str, Any]) -> None:
    """Set ``updates`` in ``folder/config.json`` (a folder being written), in the layout ``save_pretrained`` writes.

    Raises:
        CheckpointError: as :func:`read_config_json`.
    """
    config = read_config_json(folder) | dict(updates)
    (Path(folder) / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def unknown_model_type(folder: Path, model_type: object) -> UnsupportedArchitecture:
    """The one-line error for a ``model_type`` no family covers, naming config.json and the known families.

    A name transformers does not know either (a misspelling) also gets the closest family name.
    """
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    known = supported_model_types()
    close = [] if model_type in CONFIG_MAPPING_NAMES else difflib.get_close_matches(str(model_type), known, n=1)
    hint = f"did you mean {close[0]!r}? fix model_type, or " if close else "fix model_type, or "
    return UnsupportedArchitecture(
        f"{Path(folder) / 'config.json'}: model_type {model_type!r} is not an architecture symfuse knows — {hint}use "
        f"a model of a known family ({', '.join(known)})"
    )


def config_error(folder: Path, exc: BaseException) -> CheckpointError:
    """One line for a ``config.json`` that transformers could not read: bad JSON, an unknown model_type, or else."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    model_type = read_config_json(folder).get("model_type")  # raises for bad JSON (line and column)
    if model_type not in CONFIG_MAPPING_NAMES:
        return unknown_model_type(folder, model_type)
    text = " ".join(str(exc).split())
    return CheckpointError(
        f"{Path(folder) / 'config.json'}: cannot be read ({type(exc).__name__}: {text}) — fix that field as the "
        f"{model_type} config of transformers wants it (save_pretrained writes a valid one)"
    )


def head_labels_problem(raw: Mapping[str, Any]) -> str | None:
    """What is wrong with a classifier's ``id2label`` in its ``config.json`` dict, or None.

    transformers numbers a head's outputs by the keys of ``id2label``: they must be 0..n-1, one per output (a gap
    crashed evaluation), and each output's name must be its own (matching by name, two outputs called ``anger``
    could never both be a class). Placeholder names (``LABEL_<i>``) and configs without ``id2label`` pass.
    """
    id2label = raw.get("id2label")
    if id2label is None or not any("Classification" in str(a) for a in raw.get("architectures") or []):
        return None
    if not isinstance(id2label, Mapping):
        return f"id2label is a JSON {type(id2label).__name__}, not an object of output number -> class name"
    try:
        keys = sorted(id2label, key=int)
    except (TypeError, ValueError):
        bad = next(k for k in id2label if not str(k).lstrip("-").isdigit())
        return f"id2label has the key {bad!r}, not an output number"
    if (numbers := [int(k) for k in keys]) != list(range(len(keys))):
        shown = ", ".join(map(str, numbers[:12])) + (", ..." if len(numbers) > 12 else "")
        return f"id2label numbers its outputs {shown}, not 0..{len(numbers) - 1}"
    seen: dict[str, int] = {}
    for n, key in enumerate(keys):
        name = str(id2label[key]).strip().casefold()
        if name in seen:
            return f"id2label names {name!r} twice (outputs {seen[name]} and {n})"
        seen[name] = n
    return None


def check_head_labels(folder: Path, raw: Mapping[str, Any]) -> None:
    """Refuse a ``config.json`` whose ``id2label`` is malformed (see :func:`head_labels_problem`).

    Raises:
        CheckpointError: naming the file, what is wrong and the fix.
    """
    problem = head_labels_problem(raw)
    if problem:
        raise CheckpointError(
            f"{Path(folder) / 'config.json'}: {problem} — number the outputs 0..n-1 and name each once, as "
            "save_pretrained writes a head's id2label"
        )
