"""Task heads an adapter saves whole (PEFT's ``modules_to_save``: ``classifier`` / ``score`` of a SEQ_CLS adapter).

PEFT trains such a module in full and loads the saved tensors over the base's module; they are no LoRA update and
do not merge (PEFT's ``add_weighted_adapter`` refuses them). The rule of full-model merges applies: the output holds
the merged body with the FIRST adapter's head, and ``heads/<name_i>/`` the same merged body with adapter ``i``'s head,
``name_i`` its folder's name (made unique). A merge into the base needs the base to hold each head tensor in the same
shape (the classifier the adapters were trained on, saved with its head).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from symfuse.errors import CheckpointError
from symfuse.lora.adapter import LoraAdapter


def head_folders(adapters: Sequence[LoraAdapter]) -> list[str]:
    """Each adapter's head folder, in order: ``.`` for the first, else ``heads/<its folder name>`` (made unique).

    Empty when the adapters save no head.
    """
    if not adapters[0].saved_modules:
        return []
    folders = ["."]
    for i, ad in enumerate(adapters[1:], 1):
        name = ad.path.name or f"adapter{i}"
        while f"heads/{name}" in folders:
            name = f"{name}-{i}"
        folders.append(f"heads/{name}")
    return folders


def check_heads(adapters: Sequence[LoraAdapter], base_shapes: Mapping[str, tuple[int, ...]] | None) -> None:
    """Every adapter saves the same head tensors; with a base (``{name: shape}``), it holds each in that shape.

    Raises:
        CheckpointError: adapters of different heads, or a base without a head tensor of the adapter's shape.
    """
    first = adapters[0]
    for ad in adapters[1:]:
        if set(ad.saved_modules) != set(first.saved_modules):
            raise CheckpointError(
                f"{ad.path}: saves the modules {_names(ad)}, {first.path} {_names(first)} (modules_to_save) — merge "
                "adapters of one task type"
            )
    if base_shapes is None:
        return
    for ad in adapters:
        for name, t in ad.saved_modules.items():
            if base_shapes.get(name) != tuple(t.shape):
                have = f"holds it as {base_shapes[name]}" if name in base_shapes else "has no such tensor"
                raise CheckpointError(
                    f"{ad.path}: saves {name} {tuple(t.shape)} (modules_to_save), and the base {have} — give the "
                    "base as the model the adapter was trained on, with its head (save_pretrained of "
                    "AutoModelForSequenceClassification.from_pretrained(base, num_labels=N))"
                )


def _names(ad: LoraAdapter) -> str:
    return ", ".join(sorted(ad.saved_modules)) or "none"
