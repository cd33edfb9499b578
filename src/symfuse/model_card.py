"""Model cards: the ``README.md`` every merged model folder carries (Hugging Face style, YAML front matter).

The card says what the folder is without symfuse at hand: the base model, the input models (with the validation
metrics of their fine-tuning, when their folder holds ``symfuse_train.json``), the merge strategy and its
parameters, the symmetries the inputs were matched with, and how the task heads were merged or kept.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

CARD = "README.md"
TRAIN_REPORT = "symfuse_train.json"  # written by symfuse.train.finetune (not imported: it imports torch)
_NOT_METRICS = {"epoch", "split", "seconds", "train_seconds", "train_examples_per_s", "best", "primary"}


def input_metrics(folder: str | Path) -> dict[str, Any]:
    """Validation metrics of the kept epoch of a fine-tuned folder (``symfuse_train.json``), else ``{}``."""
    file = Path(folder) / TRAIN_REPORT
    if not file.is_file():
        return {}
    report = json.loads(file.read_text())
    epochs = report.get("epochs") or []
    best = next((e for e in epochs if e.get("best")), epochs[-1] if epochs else {})
    return {k: v for k, v in best.items() if k not in _NOT_METRICS and isinstance(v, int | float)}


def trained_on(folder: str | Path) -> str | None:
    """The dataset a fine-tuned folder was trained on (its ``symfuse_train.json``), else None."""
    file = Path(folder) / TRAIN_REPORT
    if not file.is_file():
        return None
    name = json.loads(file.read_text()).get("dataset")
    return str(name) if name else None


def _pipeline_tag(config: Mapping[str, Any]) -> str:
    archs = config.get("architectures") or []
    return "token-classification" if any("TokenClassification" in a for a in archs) else "text-classification"


def _fmt(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def model_card(
    strategy: str,
    params: Mapping[str, Any],
    inputs: Sequence[Mapping[str, Any]],
    config: Mapping[str, Any] | None = None,
    base: str | None = None,
    symmetries: Sequence[str] = (),
    heads: str = "merged",
    extra: Mapping[str, Any] | None = None,
    head_refit: float | None = None,
) -> str:
    """The card's text.

    Args:
        strategy: Merge strategy (a key of ``symfuse.merge.MERGERS``).
        params: Its parameters.
        inputs: One mapping per input model: ``name``, ``path``, optional ``dataset`` and ``metrics``.
        config: The merged model's ``config.json`` (architecture, labels).
        base: Base model the inputs were fine-tuned from.
        symmetries: Symmetries the inputs were matched with before merging (empty: merged as they are).
        heads: ``merged`` (one head), ``union`` (one union head, merged per class) or ``per-dataset`` (one head
            folder per input under ``heads/``).
        extra: More facts for the front matter's ``symfuse`` entry (e.g. run id, variant).
        head_refit: The ridge of the head refit (:mod:`symfuse.merge.head_refit`), or None: heads as merged.

    Returns:
        Markdown with YAML front matter.
    """
    config = dict(config or {})
    datasets = [i.get("dataset") or i["name"] for i in inputs]
    front = {
        "library_name": "transformers",
        "pipeline_tag": _pipeline_tag(config),
        "tags": ["symfuse", "merge", f"merge-{strategy}", *(["symmetry-matched"] if symmetries else [])],
        **({"base_model": base} if base else {}),
        "datasets": datasets,
        "symfuse": {
            "strategy": strategy,
            "params": dict(params),
            "symmetries": list(symmetries),
            "heads": heads,
            **({"head_refit": {"ridge": head_refit}} if head_refit is not None else {}),
            "inputs": [str(i["path"]) for i in inputs],
            **dict(extra or {}),
        },
    }
    lines = [
        "---",
        yaml.safe_dump(front, sort_keys=False).rstrip(),
        "---",
        "",
        f"# Merged model: {strategy} of {len(inputs)} models",
        "",
        f"Made by symfuse (symmetry-aware fusion) from models fine-tuned on {', '.join(datasets)}"
        + (f", all fine-tuned from `{base}`." if base else "."),
        "",
        f"- **Strategy**: `{strategy}`" + (f" ({', '.join(f'{k}={v}' for k, v in params.items())})" if params else ""),
        "- **Symmetries**: "
        + (
            ", ".join(f"`{s}`" for s in symmetries) + " (inputs matched onto each other before merging)"
            if symmetries
            else "none (inputs merged as they are)"
        ),
        "- **Heads**: " + _heads_line(heads, head_refit),
    ]
    labels = (config.get("id2label") or {}).values()
    if labels:
        lines.append(f"- **Labels** (this folder's head): {', '.join(map(str, labels))}")
    return "\n".join([*lines, *_inputs_table(inputs), *_METRICS])


_HEADS = {
    "merged": "one merged classification head",
    "union": "one head over the union of the inputs' classes, each class merged from the inputs that learned it",
    "per-dataset": "one merged body; each input's own head in `heads/<dataset>/` (the first input's here)",
}

_METRICS = [
    "",
    "## Metrics",
    "",
    "The table above gives each input's validation metrics from its fine-tuning (kept epoch; a dataset without a "
    "validation split: on records held out of its train split, never its test split). The merged model's own "
    "evaluation (in- and out-of-domain) is in the report of the symfuse run that made it.",
    "",
]


def _heads_line(heads: str, head_refit: float | None) -> str:
    """What the merged model's heads are (``heads`` as in :func:`model_card`), and whether they were refitted."""
    refit = (
        f"; refitted to the merged body in closed form (ridge {head_refit:g}) to reproduce each input's own "
        "logits on its own data"
        if head_refit is not None
        else ""
    )
    return _HEADS.get(heads, _HEADS["per-dataset"]) + refit


def _inputs_table(inputs: Sequence[Mapping[str, Any]]) -> list[str]:
    """The "Inputs" section: one row per input model, one column per metric any of them has."""
    keys = list(dict.fromkeys(k for i in inputs for k in (i.get("metrics") or {})))
    lines = ["", "## Inputs", "", "| model | dataset | path |" + "".join(f" {k} |" for k in keys)]
    lines.append("| --- | --- | --- |" + " --- |" * len(keys))
    for i in inputs:
        metrics = i.get("metrics") or {}
        cells = "".join(f" {_fmt(metrics[k]) if k in metrics else '-'} |" for k in keys)
        lines.append(f"| {i['name']} | {i.get('dataset') or i['name']} | `{i['path']}` |{cells}")
    return lines


def read_front_matter(text: str) -> dict[str, Any]:
    """The YAML front matter of a card.

    Raises:
        ValueError: if the text does not start with a ``---`` block.
    """
    if not text.startswith("---\n") or "\n---\n" not in text[4:]:
        raise ValueError("model card has no YAML front matter (expected a leading '---' block)")
    return yaml.safe_load(text[4 : text.index("\n---\n", 4)])


def card_for_display(text: str) -> str:
    """A card as markdown renders it well: its YAML front matter as a fenced ``yaml`` block, then its body."""
    if not text.startswith("---\n") or "\n---\n" not in text[4:]:
        return text
    end = text.index("\n---\n", 4)
    return f"```yaml\n{text[4:end]}\n```\n{text[end + 5 :]}"
