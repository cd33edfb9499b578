"""Models read text through their tokenizer: two models compared, interpolated or merged must share its vocabulary.

Two fine-tunes of one base carry byte-identical tokenizer files and are never loaded here. Other folders are
compared by vocabulary (token -> id, added tokens included): special tokens, chat templates and truncation settings
may differ (a base and its instruction-tuned model are still one vocabulary).
"""

from __future__ import annotations

import filecmp
import os
from pathlib import Path

from symfuse.errors import TokenizerError

# the files that decide which id a piece of text becomes (their bytes equal: the same vocabulary)
_VOCAB_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "merges.txt", "added_tokens.json", "tokenizer.model",
                "spiece.model", "sentencepiece.bpe.model")  # fmt: skip


def vocabulary_difference(a: str | os.PathLike, b: str | os.PathLike) -> str | None:
    """How ``b``'s tokenizer maps text to other ids than ``a``'s, or None (same vocabulary, or one has no tokenizer).

    Args:
        a: A checkpoint folder (or ``"minilm"`` / hub id).
        b: Another one.
    """
    from symfuse.checkpoint import resolve_checkpoint
    from symfuse.data.batches import load_tokenizer
    from symfuse.io.folder import TOKENIZER_FILES

    fa, fb = resolve_checkpoint(a), resolve_checkpoint(b)
    if not all(any((f / n).is_file() for n in TOKENIZER_FILES) for f in (fa, fb)):
        return None  # a folder without a tokenizer is refused by the commands that tokenize
    if all(_same_file(fa / n, fb / n) for n in _VOCAB_FILES):
        return None
    va, vb = load_tokenizer(fa).get_vocab(), load_tokenizer(fb).get_vocab()
    if va == vb:
        return None
    said = []
    if moved := sorted(t for t in va.keys() & vb.keys() if va[t] != vb[t]):
        t = moved[0]
        said.append(f"{len(moved)} tokens have other ids, e.g. {t!r}: {va[t]} in {a}, {vb[t]} here")
    if only := len(va.keys() ^ vb.keys()):
        said.append(f"{only} tokens are in one vocabulary only")
    return f"its tokenizer is not {a}'s ({'; '.join(said)})"


def _same_file(x: Path, y: Path) -> bool:
    """Both absent, or both present with equal bytes."""
    if x.is_file() != y.is_file():
        return False
    return not x.is_file() or filecmp.cmp(x, y, shallow=False)


def check_same_vocabulary(models: list[str | os.PathLike], why: str) -> None:
    """Refuse models whose tokenizers map text to other ids than the first's.

    Args:
        models: Checkpoint folders; the first is the reference.
        why: What the command does with them that needs one vocabulary (ends the message's fix).

    Raises:
        TokenizerError: naming the model, the first, a token whose id differs and the fix.
    """
    for m in models[1:]:
        if problem := vocabulary_difference(models[0], m):
            raise TokenizerError(f"{m}: {problem} — {why}; give models that share one tokenizer")
