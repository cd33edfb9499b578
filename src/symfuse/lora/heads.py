"""What an adapter saves besides its factors: task heads and copies of base layers.

Task heads: the modules PEFT trains whole (``modules_to_save``: ``classifier`` / ``score`` of a SEQ_CLS adapter).
PEFT loads the saved tensors over the base's module; they are no LoRA update and do not merge (PEFT's
``add_weighted_adapter`` refuses them). The rule of full-model merges applies: the output holds the merged body with
the FIRST adapter's head, and ``heads/<name_i>/`` the same merged body with adapter ``i``'s head, ``name_i`` its
folder's name (made unique). A merge into the base needs the base to hold each head tensor in the same shape (the
classifier the adapters were trained on, saved with its head). A bare base (an encoder saved without the head) is
first built as that classifier, as PEFT's users load it: :func:`task_base`. A body layer saved whole (any other
module of ``modules_to_save``) is merged as full models' tensors are: :func:`merged_body`.

Copies of base layers: PEFT saves an adapted ``lm_head`` / embedding's base layer, loaded over the base's weight
(:func:`check_saved_base`).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from symfuse.errors import CheckpointError, UsageError
from symfuse.io import SIDE_FILES, open_weight_files
from symfuse.lora.adapter import PREFIX, WEIGHTS, LoraAdapter
from symfuse.lora.bases import combine
from symfuse.scratch import scratch_dir

log = logging.getLogger(__name__)

_TASK_MODELS = {"SEQ_CLS": "AutoModelForSequenceClassification", "TOKEN_CLS": "AutoModelForTokenClassification"}
_HEADS = ("classifier", "score")  # the task heads PEFT saves for SEQ_CLS / TOKEN_CLS (its modules_to_save)


def is_head(name: str) -> bool:
    """Whether saved tensor ``name`` is a task head's (a module ending classifier / score), not a body layer's."""
    return any(part.endswith(_HEADS) for part in name.split(".")[:-1])


def own_head(adapter: LoraAdapter) -> dict[str, torch.Tensor]:
    """The task head an adapter saves whole (kept per adapter, never merged)."""
    return {n: t for n, t in adapter.saved_modules.items() if is_head(n)}


def merged_body(adapters: Sequence[LoraAdapter], name: str, w: torch.Tensor, merger: Any, weights: Any) -> torch.Tensor:
    """A body layer the adapters train whole (``modules_to_save``), merged as a full model's: ``W + merge(W_i - W)``."""
    w = w.to(torch.float64)
    return w + combine(
        merger, name, [ad.saved_modules[name].to(w.device, torch.float64) - w for ad in adapters], weights
    )


def head_folders(adapters: Sequence[LoraAdapter]) -> list[str]:
    """Each adapter's head folder, in order: ``.`` for the first, else ``heads/<its folder name>`` (made unique).

    Empty when the adapters save no head.
    """
    if not own_head(adapters[0]):
        return []
    folders = ["."]
    for i, ad in enumerate(adapters[1:], 1):
        name = ad.path.name or f"adapter{i}"
        while f"heads/{name}" in folders:
            name = f"{name}-{i}"
        folders.append(f"heads/{name}")
    return folders


def check_heads(adapters: Sequence[LoraAdapter], base_shapes: Mapping[str, tuple[int, ...]] | None) -> None:
    """Every adapter saves the same whole head; into a base (``{name: shape}`` of its tensors), exactly its head.

    PEFT loads an adapter onto a model only with every tensor of the modules ``modules_to_save`` matches there (a
    module path ending with an entry); a head saved in part would leave the rest the base's random one.

    Raises:
        CheckpointError: adapters of different heads, a head tensor saved without its weight, a head tensor the base
            lacks or holds in another shape, or one of the base's head tensors the adapter does not save.
    """
    first = adapters[0]
    for ad in adapters:
        if set(ad.saved_modules) != set(first.saved_modules):
            raise CheckpointError(
                f"{ad.path}: saves the modules {_names(ad)}, {first.path} {_names(first)} (modules_to_save) — merge "
                "adapters that save the same modules (one task type, one modules_to_save)"
            )
        lone = next((n for n in ad.saved_modules if n.endswith(".bias") and f"{n[:-5]}.weight" not in ad.saved_modules),
                    None)  # fmt: skip
        if lone is not None:
            raise CheckpointError(f"{ad.path / WEIGHTS}: saves {lone} without {lone[:-5]}.weight (modules_to_save) — "
                                  "PEFT cannot load it; re-save the adapter with its whole head")  # fmt: skip
    if base_shapes is None:
        if not first.saved_modules and (entries := first.config.get("modules_to_save")):
            log.warning("%s: modules_to_save (%s) but no head tensors saved — PEFT cannot load it (nor the output) "
                        "onto a model that has such modules", first.path, ", ".join(entries))  # fmt: skip
        return
    wanted = sorted(n for n in base_shapes if _under(n, first.config.get("modules_to_save") or ()))
    for ad in adapters:
        for name, t in ad.saved_modules.items():
            if base_shapes.get(name) != tuple(t.shape):
                have = f"holds it as {base_shapes[name]}" if name in base_shapes else "has no such tensor"
                how = " (AutoModelForSequenceClassification.from_pretrained(base, num_labels=N))" * is_head(name)
                raise CheckpointError(f"{ad.path}: saves {name} {tuple(t.shape)} (modules_to_save), and the base "
                                      f"{have} — give the base the adapter was trained on{how}")  # fmt: skip
        if missing := [n for n in wanted if n not in ad.saved_modules]:
            raise CheckpointError(
                f"{ad.path / WEIGHTS}: its modules_to_save ({', '.join(first.config['modules_to_save'])}) match the "
                f"base's {', '.join(missing[:3])}, which it does not save — PEFT cannot load it there; re-save the "
                "adapter with its head"
            )


def _under(name: str, entries: Sequence[str]) -> bool:
    """Whether tensor ``name`` lies in a module PEFT's ``modules_to_save`` matches (a module path ending so)."""
    parts = name.split(".")[:-1]
    return any(".".join(parts[:j]).endswith(e) for j in range(1, len(parts) + 1) for e in entries)


def _names(ad: LoraAdapter) -> str:
    return ", ".join(sorted(ad.saved_modules)) or "none"


def task_base(base: Path, adapters: Sequence[LoraAdapter], stack: contextlib.ExitStack, model: bool) -> Path | None:
    """``base`` saved as the classifier the adapters were trained on, in a scratch folder; None when not needed.

    PEFT trains a classifier adapter on ``AutoModelFor<task>.from_pretrained(base, num_labels=N)``: a base stored
    without the adapters' head (a bare encoder) is built so (the number of classes read from the saved head, the
    random head then replaced by an adapter's). PEFT's adapters name no classes: they are ``LABEL_i``, with a warning
    when the output is that ``model``.
    None also when the task type names no classifier, or no class count fits the saved head (the head check says why).
    """
    heads = adapters[0].saved_modules
    task = _TASK_MODELS.get(str(adapters[0].config.get("task_type")))
    if not heads or task is None or set(heads) & set(open_weight_files(base)[0]):
        return None
    import transformers

    cls, config = getattr(transformers, task), transformers.AutoConfig.from_pretrained(str(base))
    n = next((n for n in _class_counts(heads) if _fits(cls, config, n, heads)), None)
    if n is None:
        return None
    folder = stack.enter_context(scratch_dir("lora-base"))
    built = cls.from_pretrained(str(base), num_labels=n)
    built.save_pretrained(folder)
    for side in SIDE_FILES:  # the tokenizer travels with the output
        if (base / side).is_file():
            shutil.copy2(base / side, folder / side)
    what = (base, ", ".join(sorted(heads)), type(built).__name__, n)
    if model:
        log.warning("%s: holds no %s (the adapters' head); merged into it built as %s with %d classes, unnamed "
                    "(LABEL_0 ...) as PEFT's adapters name none — name them in the output's config.json (id2label, "
                    "label2id)", *what)  # fmt: skip
    else:
        log.info("%s: holds no %s (the adapters' head); read as %s with %d classes", *what)
    return folder


def _class_counts(heads: Mapping[str, torch.Tensor]) -> list[int]:
    """Candidate class counts: the rows of the head's 2-D weights (its output layer's first)."""
    weights = sorted((not n.endswith(("classifier.weight", "out_proj.weight", "score.weight")), t.shape[0])
                     for n, t in heads.items() if t.dim() == 2)  # fmt: skip
    return list(dict.fromkeys(rows for _, rows in weights))


def _fits(cls: type, config: object, n: int, heads: Mapping[str, torch.Tensor]) -> bool:
    """Whether ``cls`` with ``n`` classes holds every head tensor in its shape (built on the meta device)."""
    config = copy.deepcopy(config)
    config.num_labels = n  # transformers' setter names the classes LABEL_0 ...
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in cls.from_config(config).state_dict().items()}
    return all(shapes.get(name) == tuple(t.shape) for name, t in heads.items())


def check_saved_base(adapters: Sequence[LoraAdapter], bw: Any) -> None:
    """Each base-layer copy an adapter carries must be the base's tensor (as stored, in the copy's dtype).

    PEFT loads such a copy over the base's weight, so a merge of updates to the base is PEFT's only where they are
    equal; an equal copy is left out of the output (the base holds it).

    Args:
        adapters: The adapters.
        bw: The base's weights (``lora.merge._Base``: ``reader``, ``names``, ``stored(name)``), None: no base.

    Raises:
        CheckpointError: a copy without ``--base`` to check it against, or one that differs from the base's tensor.
    """
    for ad in adapters:
        for name, saved in ad.saved_base.items():
            where = f"{ad.path / WEIGHTS}: holds {PREFIX}{_copy_name(name)}"
            if bw is None:
                raise UsageError(f"{where}, a copy of the base's {name} (PEFT saves one for an adapted "
                                 "lm_head or embedding) — give the base with --base BASE to check that it is the "
                                 "base's")  # fmt: skip
            stored = bw.reader.get(bw.stored(name)) if bw.stored(name) in bw.names else None
            if stored is None or stored.shape != saved.shape or not torch.equal(stored.to(saved.dtype), saved):
                raise CheckpointError(f"{where}, which PEFT loads over the base's {name}, but it is not "
                                      f"{bw.reader.path}'s (a resized or trained vocabulary?) — symfuse merges "
                                      "updates of one base; merge adapters whose copy is the base's")  # fmt: skip
            log.info("%s: its copy of the base's %s equals the base's; left out of the output", ad.path, name)


def _copy_name(name: str) -> str:
    """The base-layer copy's name of base tensor ``name`` (``lm_head.weight``: ``lm_head.base_layer.weight``)."""
    key, _, leaf = name.rpartition(".")
    return f"{key}.base_layer.{leaf}"


def tied_weights(config: Any, names: set[str]) -> dict[str, str]:
    """``{tensor: the stored tensor it is tied to}`` (transformers' ``_tied_weights_keys`` of the config's class).

    An output layer tied to the input embedding (``lm_head``, a masked LM's decoder, T5's ``embed_tokens`` and
    ``shared``) is stored once: its update goes there, and changes both, as PEFT's ``merge_and_unload`` changes the
    one shared weight.
    """
    import transformers

    archs = (getattr(config, "architectures", None) or []) if getattr(config, "tie_word_embeddings", False) else []
    keys = getattr(getattr(transformers, archs[0], None), "_tied_weights_keys", None) if archs else None
    return {t: s for t, s in keys.items() if t not in names and s in names} if isinstance(keys, dict) else {}
