"""GGUF files (llama.cpp's format) turned into checkpoint folders every symfuse command reads.

A GGUF file holds the config (``<arch>.*`` keys), the tokenizer (``tokenizer.ggml.*``) and the weights, often
block-quantised, under llama.cpp's names (``blk.0.attn_q.weight``) and, for llama-like models, with the rows of
Q and K permuted for llama.cpp's RoPE. :func:`write_gguf_folder` reads it with transformers' own GGUF machinery
(the code behind ``from_pretrained(folder, gguf_file=name)``: config keys, tensor names, the Q/K un-permutation,
dequantisation, the tokenizer) and writes ``config.json``, ``model.safetensors``, the tokenizer files and
``generation_config.json`` into a folder, so the folder loads to the same logits as transformers' GGUF loading.

:func:`check_gguf` validates the header first (magic, architecture, tensor types) without reading tensor data;
:func:`gguf_cache_key` names a file's converted copy by its content. Needs the ``gguf`` extra
(``pip install 'symfuse[gguf]'``). The whole dequantised model is held in memory once while it is written.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from symfuse.errors import CheckpointError, NonFiniteError, UnsupportedArchitecture
from symfuse.io import WEIGHTS, check_finite_tensor, save_safetensors

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
GGUF_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Bumped when the conversion changes, so that cached copies written by an older symfuse are not reused.
CONVERTER_VERSION = "1"
_DIGEST_BYTES = 1 << 20


@dataclass(frozen=True)
class GgufInfo:
    """What :func:`check_gguf` read from a GGUF header.

    Attributes:
        path: The file.
        architecture: ``general.architecture`` (``llama``, ``qwen2``, ...).
        tensor_types: Names of the tensor types it holds (``F32``, ``Q4_1``, ...).
        tokenizer: Whether it carries a tokenizer (``tokenizer.ggml.model``).
    """

    path: Path
    architecture: str
    tensor_types: tuple[str, ...]
    tokenizer: bool


def is_gguf_path(path: str | os.PathLike) -> bool:
    """Whether ``path`` names a GGUF file by its suffix (``.gguf``, any case); the file need not exist."""
    return Path(path).suffix.lower() == ".gguf"


def _gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:
        return "unknown"


def _gguf_module() -> Any:
    try:
        import gguf
    except ImportError as exc:
        raise CheckpointError(
            "reading GGUF files needs the gguf package — install the extra: pip install 'symfuse[gguf]'"
        ) from exc
    return gguf


def supported_architectures() -> list[str]:
    """GGUF architectures symfuse converts: those transformers reads from GGUF that a symfuse family covers."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    from symfuse.arch import supported_model_types

    return sorted(set(GGUF_SUPPORTED_ARCHITECTURES) & set(supported_model_types()))


@functools.cache
def supported_tensor_types() -> tuple[str, ...]:
    """GGML tensor types the installed ``gguf`` package dequantises (probed on one zero block of each)."""
    import numpy as np

    gguf = _gguf_module()
    names = []
    for qtype in gguf.GGMLQuantizationType:
        _, type_size = gguf.GGML_QUANT_SIZES.get(qtype, (0, 0))
        try:
            gguf.quants.dequantize(np.zeros((1, type_size), np.uint8), qtype)
        except Exception:  # NotImplementedError, or a type the probe's block does not fit
            continue
        names.append(qtype.name)
    return tuple(names)


# numpy's words when the reader views data that the file's end cuts short (reshape; a view of wider items; an
# empty view indexed)
_CUT_SHORT = ("cannot reshape", "When changing to a larger dtype", "out of bounds for axis 0 with size 0")


def check_gguf(path: str | os.PathLike) -> GgufInfo:
    """Validate a GGUF file's header (no tensor data read): magic, architecture, tensor types.

    Raises:
        CheckpointError: not a file, not a GGUF file, an unreadable header, or a tensor type that cannot be
            dequantised (the supported ones named).
        UnsupportedArchitecture: an architecture symfuse cannot convert (the supported ones named).
    """
    path = Path(path)
    fix = "give a .gguf file written by llama.cpp or the gguf package"
    if not path.is_file():
        raise CheckpointError(f"{path}: no such GGUF file — check the path")
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != GGUF_MAGIC:
        raise CheckpointError(f"{path}: not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r}) — {fix}")
    gguf = _gguf_module()
    try:
        reader = gguf.GGUFReader(str(path))
        field = reader.fields.get("general.architecture")
        architecture = field.contents() if field is not None else None
        types = tuple(sorted({t.tensor_type.name for t in reader.tensors}))
        tokenizer = "tokenizer.ggml.model" in reader.fields
        values = {k: f.contents() for k, f in reader.fields.items() if k.startswith(f"{architecture}.")}
        tensor_names = [t.name for t in reader.tensors]
    except Exception as exc:  # truncated or garbled header: the reader raises ValueError, struct.error, ...
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        if isinstance(exc, ValueError | IndexError) and any(w in first for w in _CUT_SHORT):  # past the file's end
            size = path.stat().st_size
            raise CheckpointError(f"{path}: truncated — it ends before the data its header describes ({size} bytes "
                                  "on disk); copy or download the file again") from exc  # fmt: skip
        raise CheckpointError(f"{path}: unreadable GGUF header ({type(exc).__name__}: {first}) — {fix}") from exc
    supported = supported_architectures()
    if architecture not in supported:
        raise UnsupportedArchitecture(
            f"{path}: GGUF architecture {architecture!r} cannot be converted — symfuse reads GGUF files of "
            f"{', '.join(supported)}"
        )
    bad = [t for t in types if t not in supported_tensor_types()]
    if bad:
        raise CheckpointError(
            f"{path}: tensor type(s) {', '.join(bad)} cannot be dequantised by gguf {_gguf_version()} — "
            f"supported: {', '.join(supported_tensor_types())}"
        )
    _check_shapes(path, architecture, values, tensor_names)
    return GgufInfo(path, architecture, types, tokenizer)


def _check_shapes(path: Path, arch: str, values: dict[str, Any], tensor_names: list[str]) -> None:
    """The header's head counts divide as attention needs, and no tensor belongs to a block past ``block_count``.

    transformers would fail on the first with an error naming no file, and drop the blocks past the count
    without a word (the converted model then computes something else than the file's).

    Raises:
        CheckpointError: naming the key, its value and the fix.
    """
    fix = "re-export the GGUF with llama.cpp's convert_hf_to_gguf.py"
    for key in ("block_count", "embedding_length", "attention.head_count"):
        if f"{arch}.{key}" not in values:
            raise CheckpointError(f"{path}: the header has no {arch}.{key} — {fix}")
    heads, kv = values.get(f"{arch}.attention.head_count"), values.get(f"{arch}.attention.head_count_kv")
    width, head_dim = values.get(f"{arch}.embedding_length"), values.get(f"{arch}.attention.key_length")
    kv = heads if kv is None else kv
    if isinstance(heads, int) and isinstance(kv, int):  # per-layer lists (some architectures) are left to the loader
        if heads <= 0 or kv <= 0:
            raise CheckpointError(f"{path}: {arch}.attention.head_count is {heads} and head_count_kv {kv} — both must "
                                  f"be positive; {fix}")  # fmt: skip
        if heads % kv:
            raise CheckpointError(f"{path}: {arch}.attention.head_count_kv {kv} does not divide head_count {heads} "
                                  f"(each key/value head serves a whole group of query heads) — {fix}")  # fmt: skip
        if head_dim is None and isinstance(width, int) and width % heads:
            raise CheckpointError(f"{path}: {arch}.embedding_length {width} is not a multiple of attention."
                                  f"head_count {heads} (and no attention.key_length is given) — {fix}")  # fmt: skip
    blocks = values.get(f"{arch}.block_count")
    if isinstance(blocks, int):
        past = [n for n in tensor_names if (m := _BLOCK.match(n)) and int(m.group(1)) >= blocks]
        if past:
            raise CheckpointError(f"{path}: {arch}.block_count is {blocks} but the file holds {past[0]} — the header "
                                  f"and the tensors do not belong together; {fix}")  # fmt: skip


_BLOCK = re.compile(r"blk\.(\d+)\.")


def gguf_cache_key(path: str | os.PathLike, dtype: torch.dtype) -> str:
    """A name for the converted copy of ``path`` in ``dtype``: size, mtime, first and last MiB, converter versions.

    A rewritten or touched file gets a new key (it is converted again); a copy of the same file elsewhere with
    another mtime does too.
    """
    import transformers

    path = Path(path)
    st = path.stat()
    h = hashlib.sha256()
    versions = f"{CONVERTER_VERSION}|{transformers.__version__}|{_gguf_version()}"
    h.update(f"{st.st_size}|{st.st_mtime_ns}|{dtype}|{versions}".encode())
    with open(path, "rb") as fh:
        h.update(fh.read(_DIGEST_BYTES))
        fh.seek(max(0, st.st_size - _DIGEST_BYTES))
        h.update(fh.read(_DIGEST_BYTES))
    return h.hexdigest()[:24]


@contextlib.contextmanager
def _named(path: Path, what: str, fix: str) -> Iterator[None]:
    """Turn an error of transformers' GGUF reading into one line naming the file (ours pass through)."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as exc:  # ValueError, ZeroDivisionError, the tokenizers' Exception, a dataclass validation ...
        first = (str(exc).strip().splitlines() or [""])[0]
        raise CheckpointError(f"{path}: {what} ({type(exc).__name__}: {first}) — {fix}") from exc


def _model_class(config: Any) -> Any:
    """The transformers class of the model a GGUF holds: causal LM, else seq2seq LM, else the base model."""
    import transformers
    from transformers.models.auto import modeling_auto as auto

    for names in (auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES):
        if config.model_type in names:
            return getattr(transformers, names[config.model_type])
    return getattr(transformers, auto.MODEL_MAPPING_NAMES[config.model_type])


def _read_tensors(path: Path, config: Any, cls: Any, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every stored tensor of the model, dequantised to ``dtype`` under transformers' names (tied ones left out).

    Raises:
        CheckpointError: the file lacks a tensor the model needs, or one cannot be read as the config says.
        NonFiniteError: a tensor holds NaN or inf (after dequantisation).
    """
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):  # names and shapes only: no memory, no initialisation
        model = cls(config)
    state = model.state_dict()
    owned = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    needed = [n for n in state if n in owned]  # tied copies (lm_head of a tied model) are not stored
    with _named(path, f"its tensors cannot be read as a {config.model_type} model", "re-export the GGUF"):
        tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model, torch_dtype=dtype)
    tensors = tensors["tensors"]
    missing = [n for n in needed if n not in tensors]
    if missing:
        raise CheckpointError(
            f"{path}: {len(missing)} tensor(s) a {config.model_type} model needs are not in the file (first: "
            f"{missing[0]}) — re-export the GGUF with llama.cpp's convert_hf_to_gguf.py"
        )
    for name in needed:
        if tuple(tensors[name].shape) != tuple(state[name].shape):
            raise CheckpointError(
                f"{path}: {name} has shape {tuple(tensors[name].shape)}, the config says {tuple(state[name].shape)}"
                " — re-export the GGUF"
            )
    out = {n: tensors[n].to(dtype) if tensors[n].is_floating_point() else tensors[n] for n in needed}
    for name, t in out.items():  # every command refuses such a folder: refuse it here, naming the file
        try:
            check_finite_tensor(t, name, path)
        except NonFiniteError as exc:
            if dtype == torch.float32:
                raise
            raise NonFiniteError(  # it blamed the file ("corrupt or training diverged") for the cast's inf
                f"{path}: tensor {name!r} holds NaN / inf in {str(dtype).removeprefix('torch.')}: values past its "
                f"range ({torch.finfo(dtype).max:.5g}) become inf — convert with --dtype float32, or the file is "
                "corrupt"
            ) from exc
    return out


def write_gguf_folder(path: str | os.PathLike, folder: str | os.PathLike, dtype: str | torch.dtype = "float32") -> Path:
    """Write a GGUF file's model into ``folder`` (which exists) as a ``save_pretrained`` folder.

    Args:
        path: The .gguf file (validated with :func:`check_gguf`).
        folder: Destination folder; the caller makes it appear atomically (a temporary folder renamed).
        dtype: ``float32``, ``bfloat16`` or ``float16`` (or the torch dtype): the weights' dtype after
            dequantisation.

    Returns:
        ``folder``.

    Raises:
        CheckpointError / UnsupportedArchitecture: see :func:`check_gguf` and :func:`_read_tensors`.
    """
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    path, folder = Path(path), Path(folder)
    dtype = GGUF_DTYPES[dtype] if isinstance(dtype, str) else dtype
    info = check_gguf(path)
    fix = "re-export the GGUF with llama.cpp's convert_hf_to_gguf.py"
    with _named(path, f"its {info.architecture} metadata make no valid config", fix):
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer = None
    if info.tokenizer:  # rebuilt before the tensors are read: a broken one fails at once
        with _named(path, "its tokenizer cannot be rebuilt", fix):
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        tokens, rows = getattr(tokenizer, "vocab_size", len(tokenizer)), getattr(config, "vocab_size", None)
        if isinstance(rows, int) and tokens > rows:  # every command refused the converted folder, blaming it
            raise CheckpointError(f"{path}: its tokenizer has {tokens} tokens but its model embeds {rows} — the "
                                  f"file's tokenizer and weights do not belong together; {fix}")  # fmt: skip
    cls = _model_class(config)
    tensors = _read_tensors(path, config, cls, dtype)
    save_safetensors(tensors, folder / WEIGHTS, metadata={"format": "pt", "source": f"gguf:{path.name}"})
    del tensors
    config.architectures = [cls.__name__]
    config.dtype = dtype
    config.save_pretrained(str(folder))
    if cls.can_generate():
        GenerationConfig.from_model_config(config).save_pretrained(str(folder))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(folder))
    else:
        log.warning("%s: no tokenizer in the GGUF file; the converted folder has none", path)
    return folder
