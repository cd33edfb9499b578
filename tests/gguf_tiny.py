"""A tiny llama written to a GGUF file with the ``gguf`` package, the way llama.cpp's convert_hf_to_gguf.py does.

Q and K rows are permuted as llama.cpp permutes them (so a reader that forgets to undo it gets other logits);
weights are stored as F32, F16 or a block-quantised type; a byte-level BPE tokenizer rides in the metadata.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers as T

# widths are multiples of 32: the quantised types pack rows in blocks of 32 values
CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
MERGES = ["Ġ t", "h e", "Ġt he", "Ġ a", "i n"]
SPECIAL = "<|endoftext|>"


def byte_alphabet() -> list[str]:
    """GPT-2's printable spelling of the 256 bytes, in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def vocabulary() -> list[str]:
    """256 byte tokens, one token per merge, then the end-of-text token."""
    return byte_alphabet() + ["".join(m.split(" ")) for m in MERGES] + [SPECIAL]


def tiny_llama(seed: int = 0) -> T.LlamaForCausalLM:
    """A random tiny llama (untied head) over :func:`vocabulary`, in eval mode."""
    torch.manual_seed(seed)
    vocab = len(vocabulary())
    cfg = T.LlamaConfig(vocab_size=vocab, bos_token_id=vocab - 1, eos_token_id=vocab - 1, **CONFIG)
    model = T.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms away from 1, so that a dropped norm changes the logits
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order (convert_hf_to_gguf.py ``permute``): each head's halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def gguf_tensors(model: T.LlamaForCausalLM) -> dict[str, np.ndarray]:
    """The model's weights under llama.cpp's names, Q and K permuted, as float32 arrays."""
    cfg = model.config
    out = {}
    for name, t in model.state_dict().items():
        w = t.float().numpy()
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = w
        elif name == "model.norm.weight":
            out["output_norm.weight"] = w
        elif name == "lm_head.weight":
            out["output.weight"] = w
        else:
            _, _, layer, rest = name.split(".", 3)
            module = rest.removesuffix(".weight")
            if module == "self_attn.q_proj":
                w = _llama_cpp_permute(w, cfg.num_attention_heads)
            elif module == "self_attn.k_proj":
                w = _llama_cpp_permute(w, cfg.num_key_value_heads)
            out[f"blk.{layer}.{_NAMES[module]}.weight"] = w
    return out


def write_gguf(
    model: T.LlamaForCausalLM,
    path: Path,
    qtype: str = "F32",
    tokenizer: bool = True,
    header: dict[str, int | None] | None = None,
    tokens: list[str] | None = None,
    tensors: dict[str, np.ndarray] | None = None,
) -> Path:
    """Write ``model`` as a GGUF file; 2-d weights in ``qtype`` (F32, F16, Q8_0, ...), norms in F32.

    ``header`` overrides ``block_count`` / ``head_count`` / ``head_count_kv`` (None: the first two left out),
    ``tokens`` the vocabulary and ``tensors`` some of the weights (bad files for the tests).
    """
    import gguf

    cfg = model.config
    header = {"block_count": cfg.num_hidden_layers, "head_count": cfg.num_attention_heads,
              "head_count_kv": cfg.num_key_value_heads, **(header or {})}  # fmt: skip
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny llama")
    if header["block_count"] is not None:  # None: the key left out
        writer.add_block_count(header["block_count"])
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    if header["head_count"] is not None:
        writer.add_head_count(header["head_count"])
    writer.add_head_count_kv(header["head_count_kv"])
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_vocab_size(cfg.vocab_size)
    if tokenizer:
        tokens = vocabulary() if tokens is None else tokens
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("gpt2")
        writer.add_token_list(tokens)
        writer.add_token_types([1] * (len(tokens) - 1) + [3])  # 3: control
        writer.add_token_merges(MERGES)
        writer.add_bos_token_id(len(tokens) - 1)
        writer.add_eos_token_id(len(tokens) - 1)
        writer.add_add_bos_token(False)
    kind = gguf.GGMLQuantizationType[qtype]
    for name, w in {**gguf_tensors(model), **(tensors or {})}.items():
        if w.ndim == 1 or kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, w.astype(np.float32))
        elif kind == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, w.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(w, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
