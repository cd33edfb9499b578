"""LoRA adapters (PEFT folders): read, merge in a basis-independent way, write (no PEFT import).

:mod:`symfuse.lora.adapter` reads and writes folders, :mod:`symfuse.lora.bases` holds the per-module maths
(KnOTS's shared basis, the full-update merge, the naive factor merge, the truncated re-factoring) and
:mod:`symfuse.lora.merge` the whole merge (:func:`merge_adapters`).
"""

from symfuse.lora.adapter import LoraAdapter, LoraModule, is_adapter, read_adapter, write_adapter
from symfuse.lora.merge import merge_adapters

__all__ = ["LoraAdapter", "LoraModule", "is_adapter", "merge_adapters", "read_adapter", "write_adapter"]
