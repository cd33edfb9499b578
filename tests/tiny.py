"""Tiny random models of every family, built in-test (no downloads)."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers as T

_SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48)

FAMILIES = (
    "bert",
    "roberta",
    "distilbert",
    "deberta-v2",
    "deberta-v2-shared",
    "vit",
    "gpt2",
    "llama",
    "electra",
    "qwen3",
    "gemma",
    "gemma2",
    "phi3",
    "albert",
    "t5",
    "t5-gated",
    "clip",
)
# language models, tested with head="lm" (T5: the encoder-decoder T5ForConditionalGeneration)
DECODERS = ("gpt2", "llama", "qwen3", "gemma", "gemma2", "phi3", "t5", "t5-gated")
_DECODER = dict(vocab_size=64, max_position_embeddings=64, num_key_value_heads=2, pad_token_id=0, **_SMALL)


def tiny_config(family: str, **overrides) -> T.PretrainedConfig:
    """A tiny config of ``family`` (``deberta-v2-shared`` = DeBERTa with share_att_key)."""
    if family == "bert":
        cfg = T.BertConfig(vocab_size=64, max_position_embeddings=64, **_SMALL)
    elif family == "roberta":
        cfg = T.RobertaConfig(vocab_size=64, max_position_embeddings=70, pad_token_id=1, **_SMALL)
    elif family == "distilbert":
        cfg = T.DistilBertConfig(
            vocab_size=64, max_position_embeddings=64, dim=32, n_layers=2, n_heads=4, hidden_dim=48
        )
    elif family.startswith("deberta-v2"):
        cfg = T.DebertaV2Config(
            vocab_size=64,
            max_position_embeddings=64,
            relative_attention=True,
            pos_att_type=["p2c", "c2p"],
            share_att_key=family.endswith("shared"),
            position_buckets=8,
            max_relative_positions=16,
            norm_rel_ebd="layer_norm",
            **_SMALL,
        )
    elif family == "vit":
        cfg = T.ViTConfig(image_size=8, patch_size=4, num_channels=3, **_SMALL)
    elif family == "gpt2":
        cfg = T.GPT2Config(
            vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64, n_inner=48, bos_token_id=0, eos_token_id=0
        )
    elif family == "llama":
        cfg = T.LlamaConfig(vocab_size=64, max_position_embeddings=64, num_key_value_heads=2, **_SMALL)
    elif family == "electra":  # embedding_size != hidden_size: embeddings_project writes the stream
        cfg = T.ElectraConfig(vocab_size=64, max_position_embeddings=64, embedding_size=16, **_SMALL)
    elif family == "qwen3":
        cfg = T.Qwen3Config(head_dim=8, **_DECODER)
    elif family == "gemma":
        cfg = T.GemmaConfig(head_dim=8, **_DECODER)
    elif family == "gemma2":  # soft-capping and the sliding window really act on tiny inputs
        cfg = T.Gemma2Config(
            head_dim=8,
            query_pre_attn_scalar=6,
            attn_logit_softcapping=0.5,
            final_logit_softcapping=0.5,
            sliding_window=4,
            **_DECODER,
        )
    elif family == "albert":  # 3 applications of 1 shared stored layer
        cfg = T.AlbertConfig(
            vocab_size=64, max_position_embeddings=64, embedding_size=16, **{**_SMALL, "num_hidden_layers": 3}
        )
    elif family == "phi3":
        cfg = T.Phi3Config(bos_token_id=0, eos_token_id=0, **_DECODER)
    elif family.startswith("t5"):  # 2 encoder and 3 decoder layers; d_kv * heads != d_model; t5-gated: v1.1 FFN
        cfg = T.T5Config(
            feed_forward_proj="gated-gelu" if family == "t5-gated" else "relu",
            vocab_size=64,
            d_model=32,
            d_kv=6,
            d_ff=48,
            num_layers=2,
            num_decoder_layers=3,
            num_heads=4,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=16,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=1,
        )
    elif family == "clip":  # two towers of different widths projected into one 16-d space
        text = dict(vocab_size=64, max_position_embeddings=16, bos_token_id=0, eos_token_id=2, pad_token_id=1)
        vision = dict(image_size=8, patch_size=4, num_channels=3)
        cfg = T.CLIPConfig(
            text_config={**_SMALL, **text},
            vision_config={**_SMALL, "hidden_size": 24, "intermediate_size": 40, **vision},
            projection_dim=16,
        )
    else:
        raise ValueError(family)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def tiny_model(family: str, seed: int = 0, head: str = "base", **overrides) -> torch.nn.Module:
    """A tiny random model in eval mode; ``head`` in base | seq | token | lm | mlm."""
    cfg = tiny_config(family, **overrides)
    if head in ("seq", "token"):
        cfg.num_labels = 3
    torch.manual_seed(seed)
    if family == "clip":  # one model for every head: both towers and their projections
        model = T.CLIPModel(cfg)
    elif family.startswith("t5") and head == "lm":
        model = T.T5ForConditionalGeneration(cfg)
    elif head == "base":
        model = T.AutoModel.from_config(cfg)
    elif head == "seq":
        model = (
            T.ViTForImageClassification(cfg)
            if family == "vit"
            else T.AutoModelForSequenceClassification.from_config(cfg)
        )
    elif head == "token":
        model = T.AutoModelForTokenClassification.from_config(cfg)
    elif head == "lm":
        model = T.AutoModelForCausalLM.from_config(cfg)
    elif head == "mlm":
        model = T.AutoModelForMaskedLM.from_config(cfg)
    else:
        raise ValueError(head)
    with torch.no_grad():  # random, non-trivial norms and biases so that transforms are really exercised
        for name, p in model.named_parameters():
            if "norm" in name.lower() or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def random_inputs(model: torch.nn.Module, batch: int = 2, seq: int = 7, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random inputs the model accepts (token ids or pixel values), with some padding."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    if cfg.model_type == "vit":
        return {"pixel_values": torch.randn(batch, cfg.num_channels, cfg.image_size, cfg.image_size, generator=g)}
    text = cfg.text_config if cfg.model_type == "clip" else cfg
    ids = torch.randint(2, text.vocab_size, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, -2:] = 0
    out = {"input_ids": ids, "attention_mask": mask}
    if cfg.model_type == "t5":
        out["decoder_input_ids"] = torch.randint(2, cfg.vocab_size, (batch, max(1, seq - 2)), generator=g)
    if cfg.model_type == "clip":
        vis = cfg.vision_config
        out["pixel_values"] = torch.randn(batch, vis.num_channels, vis.image_size, vis.image_size, generator=g)
    return out


def save_tiny(folder: Path, family: str, seed: int = 0, head: str = "base", **overrides) -> Path:
    """Save a tiny model as a safetensors ``save_pretrained`` folder and return the folder."""
    model = tiny_model(family, seed=seed, head=head, **overrides)
    model.save_pretrained(folder)
    return Path(folder)


def save_tiny_text_classifier(folder: Path, seed: int = 0, num_labels: int = 2) -> Path:
    """A tiny BERT sequence classifier with the real MiniLM tokenizer (fast, reads real text), saved to ``folder``."""
    from symfuse.checkpoint import resolve_checkpoint

    tok = T.AutoTokenizer.from_pretrained(str(resolve_checkpoint("minilm")))
    torch.manual_seed(seed)
    T.BertForSequenceClassification(
        tiny_config("bert", vocab_size=tok.vocab_size, num_labels=num_labels)
    ).save_pretrained(folder)
    tok.save_pretrained(folder)
    return Path(folder)


def nan_copy(src: Path, out: Path) -> Path:
    """A copy of the tiny BERT folder ``src`` with one NaN in a query weight (a bad input found by reading weights)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    weights = load_file(str(src / "model.safetensors"))
    name = next(k for k in weights if k.endswith("attention.self.query.weight"))
    weights[name][0, 0] = float("nan")
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
