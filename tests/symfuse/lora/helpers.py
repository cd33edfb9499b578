"""Tiny LoRA / DoRA / rsLoRA adapters made with PEFT on a tiny Llama, and their effective weights."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers as T
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file

from tests.tiny import save_tiny

TARGETS = ["q_proj", "v_proj", "down_proj"]
PREFIX = "base_model.model."


def tiny_base(folder: Path) -> Path:
    """A tiny Llama causal LM saved to ``folder``."""
    return save_tiny(folder, "llama", head="lm")


def make_adapter(
    base: Path, out: Path, seed: int, r: int = 4, alpha: float = 8, targets: list[str] | None = None,
    auto: type = T.AutoModelForCausalLM, **kw,
) -> Path:  # fmt: skip
    """A PEFT adapter of ``base`` (loaded with ``auto``) with random non-zero A and B (DoRA: random magnitudes too)."""
    model = auto.from_pretrained(str(base))
    torch.manual_seed(seed)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets or TARGETS, init_lora_weights=False, **kw)
    peft = get_peft_model(model, cfg)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn_like(p) if "magnitude" not in name else p * (1 + 0.2 * torch.rand_like(p)))
    peft.save_pretrained(str(out))
    return out


def modules(adapter: Path) -> list[str]:
    """The adapted modules' keys."""
    names = load_file(str(adapter / "adapter_model.safetensors"))
    return sorted({n[len(PREFIX) : -len(".lora_A.weight")] for n in names if n.endswith(".lora_A.weight")})


def effective_weights(base: Path, adapter: Path | None, auto: type = T.AutoModelForCausalLM) -> dict[str, torch.Tensor]:
    """Every weight of ``base`` (loaded with ``auto``) with ``adapter`` merged by PEFT (merge_and_unload), float64."""
    from peft import PeftModel

    model = auto.from_pretrained(str(base))
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    return {k: v.detach().to(torch.float64) for k, v in model.state_dict().items()}


def worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference over ``want``'s tensors."""
    return max(float((got[k] - want[k]).abs().max()) for k in want)


def rebased(adapter: Path, out: Path, seed: int = 0) -> Path:
    """A copy of ``adapter`` with every ``(B, A)`` replaced by ``(B M, M^-1 A)`` (same update, other basis)."""
    import shutil

    shutil.copytree(adapter, out)
    t = load_file(str(adapter / "adapter_model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    for name in [n for n in t if n.endswith(".lora_A.weight")]:
        b_name = name.replace("lora_A", "lora_B")
        a, b = t[name].to(torch.float64), t[b_name].to(torch.float64)
        q, _ = torch.linalg.qr(torch.randn(a.shape[0], a.shape[0], generator=g, dtype=torch.float64))
        m = q @ torch.diag(torch.linspace(0.5, 2.0, a.shape[0], dtype=torch.float64))  # condition number 4
        t[b_name] = (b @ m).to(t[b_name].dtype).contiguous()
        t[name] = torch.linalg.solve(m, a).to(t[name].dtype).contiguous()
    save_file(t, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out


def edited_copy(adapter: Path, out: Path, **changes) -> Path:
    """A copy of ``adapter`` at ``out`` whose ``adapter_config.json`` has ``changes``."""
    import json
    import shutil

    shutil.copytree(adapter, out)
    cfg = json.loads((out / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**cfg, **changes}))
    return out
