"""Two small GPT-2 language models trained from different seeds on one dataset's texts (the different-seed recipe).

    .venv/bin/python examples/two_seeds.py --out seeds [--steps 300] [--data crowdflower] [--device auto]

writes ``seeds/a`` and ``seeds/b``: the same architecture, data and data order, initialised from seeds 0 and 1
(no dropout), each a ``save_pretrained`` folder with the MiniLM tokenizer it was trained with. Two such models share
no basin: ``symfuse inspect seeds/a seeds/b`` says ``align-first``, and ``symfuse match ... --symmetries
residual-orthogonal,...`` brings one to the other before a merge (README, "Models trained from different seeds").
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

import torch
import transformers as T

from symfuse.checkpoint import resolve_checkpoint
from symfuse.cli.boundary import run_script
from symfuse.data import make_batches
from symfuse.data.batches import load_tokenizer
from symfuse.device import resolve_device
from symfuse.errors import UsageError

log = logging.getLogger("two_seeds")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The script's options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="folder for a/ and b/ (must not exist)")
    p.add_argument("--data", default="crowdflower", help="dataset whose train texts the models learn")
    p.add_argument("--steps", type=int, default=300, help="optimiser steps per model")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks")
    p.add_argument("--d-model", type=int, default=128, help="width of the residual stream")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--max-length", type=int, default=64, help="tokens per text at most")
    p.add_argument("--batch-size", type=int, default=16, help="texts per step")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    return p.parse_args(argv)


def checked_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, each in its range (a usage error otherwise)."""
    args = parse_args(argv)
    small = min(args.steps, args.layers, args.d_model, args.heads, args.batch_size) < 1
    if small or args.max_length < 2 or args.d_model % max(args.heads, 1) or not args.lr > 0:
        raise UsageError("--steps, --layers, --d-model, --heads and --batch-size must be >= 1, --max-length >= 2, "
                         "--lr > 0, and --d-model a multiple of --heads")  # fmt: skip
    return args


def train(seed: int, batches: list[dict], vocab: int, args: argparse.Namespace, device: torch.device) -> Any:
    """One GPT-2 initialised from ``seed`` and trained on ``batches`` (cycled) by next-token loss.

    Its LM head is its own tensor (``tie_word_embeddings=False``): ``residual-orthogonal`` moves the final norm's
    gain into the head, so an aligned model's head differs from its embedding, and ``merge`` pairs tensors by name.
    """
    torch.manual_seed(seed)
    cfg = T.GPT2Config(vocab_size=vocab, n_positions=args.max_length, n_embd=args.d_model, n_layer=args.layers,
                       n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                       tie_word_embeddings=False)  # fmt: skip
    model = T.GPT2LMHeadModel(cfg).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    for step in range(args.steps):
        batch = batches[step % len(batches)]
        ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
        loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == args.steps - 1:
            log.info("seed %d step %d loss %.3f", seed, step, float(loss.detach()))
    return model.eval()


def main(argv: list[str] | None = None) -> int:
    """Train and save the two models; returns the exit status."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = checked_args(argv)
    if args.out.exists():
        raise SystemExit(f"error: {args.out}: already exists — choose another --out")
    device = resolve_device(args.device, "--device")
    tok = load_tokenizer(resolve_checkpoint("minilm"))
    batches = make_batches(args.data, tok, "train", args.batch_size, args.max_length, shuffle=True)
    for name, seed in (("a", 0), ("b", 1)):
        model = train(seed, batches, len(tok), args, device)
        model.save_pretrained(args.out / name)
        tok.save_pretrained(args.out / name)
    print(f"wrote {args.out / 'a'} and {args.out / 'b'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_script(main))
