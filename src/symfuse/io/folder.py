"""Checkpoint folders validated once, before any heavy work: weight files, shard index, shapes, values, tokenizer.

* :func:`open_weight_files`: the folder's ``model.safetensors`` or sharded index, every header validated
  (:func:`~symfuse.io.safetensors.read_header`); the index must be a JSON object whose ``weight_map`` names
  files inside the folder (no absolute path, no ``..``), each of which exists and holds the tensors the index
  says it holds.
* :func:`check_module_shapes`: every attention / FFN tensor the architecture spec needs is present, floating
  point and shaped as the config says; a classification head has as many outputs as the config names classes.
* :func:`check_finite` / :func:`check_finite_tensor`: a streamed NaN / inf check, chunk by chunk.
* :func:`check_tokenizer`: the tokenizer files a tokenizing command needs.

Every failure is a :class:`~symfuse.errors.SymfuseError` whose one-line message names the artifact, what is
wrong and the fix.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from typing import Any

import torch

from symfuse.errors import CheckpointError, NonFiniteError, TokenizerError
from symfuse.io.memo import FileMemo
from symfuse.io.modes import not_readable
from symfuse.io.safetensors import BufferPool, TensorFile

WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
# Any one of these makes a tokenizer transformers can build (fast JSON, WordPiece, BPE, SentencePiece).
TOKENIZER_FILES = (
    "tokenizer.json",
    "vocab.txt",
    "vocab.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
)
# Files that travel with a checkpoint when it is rewritten or stored (tokenizer, generation settings, ...).
SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "merges.txt",
    "vocab.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "generation_config.json",
    "preprocessor_config.json",
    "chat_template.jinja",  # transformers 5 writes a tokenizer's chat template beside it
)
MIN_VOCAB = 256
_CHUNK_BYTES = 1 << 24


def _index_files(folder: Path) -> dict[str, str]:
    """``{tensor: file name}`` of a sharded index, validated (JSON, confined to ``folder``)."""
    index = folder / WEIGHTS_INDEX
    try:
        data = json.loads(index.read_text())
    except PermissionError as exc:
        raise not_readable(index) from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{index}: not valid JSON ({exc}) — re-export the checkpoint") from exc
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: no 'weight_map' object naming the shard of every tensor — re-export it")
    for name, fname in weight_map.items():
        pure = PurePosixPath(str(fname))
        if (
            not isinstance(fname, str)
            or not fname
            or pure.is_absolute()
            or ".." in pure.parts
            or "\\" in fname
            or Path(fname).is_absolute()
        ):
            raise CheckpointError(
                f"{index}: tensor {name!r} points at {fname!r}, outside the checkpoint folder — "
                "shards must be plain file names inside the folder; fix the index"
            )
        # confined by name only: hub snapshots are folders of symlinks into a blob store, which are fine
    return weight_map


def checkpoint_files(folder: str | os.PathLike) -> list[Path]:
    """The files that make a checkpoint folder: config, weights (and shard index), side files, card and record.

    The model card and fine-tuning record are ``README.md`` and ``symfuse_train.json`` (a merge's card reads it).
    What else a training folder holds (``checkpoint-*/`` with optimizer states, ``training_args.bin``, logs) is
    left out. The weight files are validated (:func:`open_weight_files`).
    """
    folder = Path(folder)
    weights = sorted(set(open_weight_files(folder)[0].values()))
    kept = ("config.json", WEIGHTS_INDEX, *SIDE_FILES, "README.md", "symfuse_train.json")
    named = [folder / n for n in kept if (folder / n).is_file()]
    return named + [w for w in weights if w not in named]


def open_weight_files(folder: str | os.PathLike) -> tuple[dict[str, Path], dict[Path, TensorFile]]:
    """The tensors of a checkpoint folder and its validated weight files.

    Args:
        folder: A ``save_pretrained`` folder.

    Returns:
        ``({tensor name: file}, {file: TensorFile})``; every header is validated once here.

    Raises:
        CheckpointError: no weights, a bad index (see the module docstring), a missing shard, a tensor the
            index names that its shard lacks, a bad safetensors file, or both a single weights file and an index
            of other shards (two models in one folder).
    """
    folder = Path(folder)
    index = folder / WEIGHTS_INDEX
    if index.exists():
        mapping = {name: folder / fname for name, fname in _index_files(folder).items()}
        single = folder / WEIGHTS
        if single.exists() and set(mapping.values()) != {single}:
            raise CheckpointError(
                f"{folder}: holds both {WEIGHTS} and a {WEIGHTS_INDEX} naming other shards — transformers loads the "
                "first and the index may describe another model; remove the one that does not belong"
            )
        files: dict[Path, TensorFile] = {}
        for file in sorted(set(mapping.values())):
            if not file.is_file():
                raise CheckpointError(f"{index}: shard {file.name} is missing from {folder} — copy the whole folder")
            files[file] = TensorFile(file)
        for name, file in mapping.items():
            if name not in files[file].header.tensors:
                raise CheckpointError(
                    f"{index}: says {name!r} is in {file.name}, but that shard does not hold it — re-export the "
                    "checkpoint (the index and its shards do not belong together)"
                )
        return mapping, files
    single = folder / WEIGHTS
    if single.exists():
        tf = TensorFile(single)
        return dict.fromkeys(tf.keys(), single), {single: tf}
    raise CheckpointError(f"{folder}: no {WEIGHTS} or {WEIGHTS_INDEX} — save the model with safe_serialization")


def expected_module_shapes(spec: Any, ref: Any, config: Any, prefix: str) -> dict[str, tuple[int, ...]]:
    """Stored shapes of one module's weights and biases as the config implies them (``{name: shape}``).

    Roles whose shape the geometry does not fix (DeBERTa's position projections) are left out.
    """
    geo = spec.geometry(config).of(ref.stack)
    q_out, kv_out = geo.n_heads * geo.head_dim, geo.n_kv_heads * geo.head_dim
    d, f = geo.d_model, geo.d_ffn
    canonical = {
        "q": (q_out, d),
        "k": (kv_out, d),
        "v": (kv_out, d),
        "qkv": (q_out + 2 * kv_out, d),
        "o": (d, q_out),
        "q_norm": (geo.head_dim,),
        "k_norm": (geo.head_dim,),
        "up": (f, d),
        "gate": (f, d),
        "gate_up": (2 * f, d),
        "down": (d, f),
    }
    out: dict[str, tuple[int, ...]] = {}
    for role, name in spec.tensor_names(ref, config, prefix).items():
        base = role.removesuffix("_bias")
        if base not in canonical:
            continue
        shape = canonical[base]
        if role.endswith("_bias"):
            out[name] = (shape[0],)
        else:
            out[name] = (shape[1], shape[0]) if spec.conv1d and len(shape) == 2 else shape
    return out


def check_module_shapes(
    folder: Path, spec: Any, config: Any, prefix: str, files: dict[str, Path], tensor_files: dict[Path, TensorFile]
) -> None:
    """Every attention / FFN weight the spec needs is stored, floating point and shaped as the config says.

    A classification head must store as many outputs as the config names classes (:func:`_check_head_outputs`).

    Raises:
        CheckpointError: a missing weight, an integer / bool module tensor, or a shape that disagrees with
            ``config.json`` (a classification head of another number of classes included).
    """
    for ref in spec.modules(config):
        names = spec.tensor_names(ref, config, prefix)
        if ref.kind == "attn":
            need = [names["o"]] + ([names["qkv"]] if "qkv" in names else [names[r] for r in ("q", "k", "v")])
        else:  # fused gate_up, or up (+ gate)
            need = [names["down"]] + [names[r] for r in ("gate_up", "up", "gate") if r in names]
        missing = [n for n in need if n not in files]
        if missing:
            raise CheckpointError(
                f"{folder}: {ref.key} weights {missing[:3]} are missing — the checkpoint is incomplete for its "
                f"config ({spec.family}, {spec.geometry(config).n_layers} layers); re-export or fix config.json"
            )
        for name, shape in expected_module_shapes(spec, ref, config, prefix).items():
            if name not in files:
                continue
            info = tensor_files[files[name]].info(name)
            if not info.dtype.is_floating_point:
                raise CheckpointError(
                    f"{files[name]}: {name} is stored as {info.dtype}; symmetries transform float tensors only — "
                    "store the weights as float16 / bfloat16 / float32"
                )
            if info.shape != shape:
                raise CheckpointError(
                    f"{files[name]}: {name} has shape {list(info.shape)} but config.json implies {list(shape)} — "
                    "the config and the weights do not belong together"
                )
    _check_layer_count(folder, spec, config, prefix, files)
    _check_head_outputs(folder, config, prefix, files, tensor_files)
    _check_lm_head(folder, spec, config, prefix, files)


_LM_CLASSES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")  # classes whose LM head is ``lm_head``


def _check_lm_head(folder: Path, spec: Any, config: Any, prefix: str, files: dict[str, Path]) -> None:
    """An LM head that ``config.json`` unties from the input embedding is stored.

    transformers draws a missing one at random on every load: two loads of the folder differed by 0.5 in logits,
    and ``match`` verified its "exact" result against one such draw.

    Raises:
        CheckpointError: ``tie_word_embeddings`` is false and ``lm_head.weight`` is not stored.
    """
    archs = getattr(config, "architectures", None) or []
    if getattr(config, "tie_word_embeddings", True) or not any(a.endswith(_LM_CLASSES) for a in archs):
        return
    for head in spec.head_paths(prefix):
        if head.path.endswith("lm_head") and head.path + ".weight" not in files:
            raise CheckpointError(
                f"{folder}: {head.path}.weight is missing while config.json unties it from the input embedding "
                "(tie_word_embeddings: false), so every load would draw it at random — re-export the checkpoint, "
                "or set tie_word_embeddings: true if its head is the embedding"
            )


def _check_layer_count(folder: Path, spec: Any, config: Any, prefix: str, files: dict[str, Path]) -> None:
    """No stored tensor belongs to a layer past the count ``config.json`` gives its stack.

    A config of fewer layers than the weights would have the extra layers copied untransformed into an aligned
    model, which then computes something else than the model it came from.

    Raises:
        CheckpointError: a tensor of layer ``i >= n_layers``.
    """
    geo = spec.geometry(config)
    limits: dict[str, tuple[int, str]] = {}
    for st in spec.all_stacks():
        cfg = getattr(config, st.config) if st.config else config
        key = getattr(cfg, "attribute_map", {}).get(st.n_layers_key, st.n_layers_key)  # as config.json spells it
        entry = (geo.of(st.name).n_layers, f"{st.config}.{key}" if st.config else key)
        limits[st.layer] = max(limits.get(st.layer, entry), entry)
    for template, (n, key) in limits.items():
        before, after = template.split("{i}")
        pattern = re.compile(re.escape(prefix + before) + r"(\d+)" + re.escape(after) + r"\.")
        over = [(int(m.group(1)), name) for name in files if (m := pattern.match(name)) and int(m.group(1)) >= n]
        if over:
            layer, name = max(over)
            raise CheckpointError(
                f"{folder}/config.json: {key} is {n} but the weights hold layer {layer} ({name}) — the config and "
                f"the weights do not belong together; set {key} to the stored count or re-export the checkpoint"
            )


# transformers builds these heads' output layer with config.num_labels outputs (len(id2label))
_CLASS_HEADS = ("ForSequenceClassification", "ForTokenClassification", "ForImageClassification")


def _check_head_outputs(
    folder: Path, config: Any, prefix: str, files: dict[str, Path], tensor_files: dict[Path, TensorFile]
) -> None:
    """A classification head stores an output layer of as many outputs as ``config.json`` names classes.

    Headers only: some head tensor (outside the base model's ``prefix``) must have ``num_labels`` rows. A config
    whose ``id2label`` was edited without the head (or the reverse) would be merged or aligned with the wrong class
    names, and refused only when a model is built from it.

    Raises:
        CheckpointError: no head tensor has ``num_labels`` rows.
    """
    arch = (getattr(config, "architectures", None) or [""])[0] or ""
    if not prefix or not arch.endswith(_CLASS_HEADS):
        return
    head = {n: tuple(tensor_files[f].info(n).shape) for n, f in files.items() if not n.startswith(prefix)}
    classes = config.num_labels
    if not head or any(shape and shape[0] == classes for shape in head.values()):
        return
    shapes = ", ".join(f"{n} {list(s)}" for n, s in sorted(head.items())[:3])
    raise CheckpointError(
        f"{folder}/config.json: {classes} classes (num_labels / id2label) but no tensor of the {arch} head has "
        f"{classes} outputs ({shapes}) — make config.json describe the stored head, or re-save the model with "
        "save_pretrained"
    )


def check_finite_tensor(t: torch.Tensor, name: str, where: str | os.PathLike) -> torch.Tensor:
    """Raise :class:`NonFiniteError` naming ``where`` and ``name`` if a float tensor holds NaN or inf.

    One reduction: a sum is finite whenever every element is (NaN and inf propagate); only a non-finite sum
    (NaN / inf, or a finite overflow) is checked element by element. Returns ``t``.
    """
    if t.is_floating_point() and t.numel() and not torch.isfinite(t.sum()) and not torch.isfinite(t).all():
        bad = int((~torch.isfinite(t)).sum())
        raise NonFiniteError(
            f"{where}: tensor {name!r} holds {bad} NaN / inf value(s) — the file is corrupt or training diverged; "
            "use another checkpoint or re-export it"
        )
    return t


_FINITE: FileMemo[bool] = FileMemo()  # whole files this process found finite (see symfuse.io.memo)


def check_finite(
    tensor_files: Iterable[TensorFile], names: Iterable[str] | None = None, chunk_bytes: int = _CHUNK_BYTES
) -> None:
    """Stream every float tensor of some files (or only ``names``) and refuse NaN / inf, chunk by chunk.

    Memory is one chunk; each chunk is one ``preadv`` and one reduction. A whole file found finite is not read again
    by this process while it is unchanged (a model evaluated on several sets is checked once).

    Raises:
        NonFiniteError: naming the file and the tensor.
    """
    wanted = set(names) if names is not None else None
    pool = BufferPool()
    for tf in tensor_files:
        if wanted is not None:  # a check of some tensors only is neither skipped nor remembered
            _check_file_finite(tf, wanted, pool, chunk_bytes)
            continue
        ident, finite = _FINITE.lookup(tf.path)
        if finite:
            continue
        _check_file_finite(tf, wanted, pool, chunk_bytes)
        _FINITE.remember(tf.path, ident, True)


def _check_file_finite(tf: TensorFile, wanted: set[str] | None, pool: BufferPool, chunk_bytes: int) -> None:
    """:func:`check_finite` for one file."""
    for name, info in tf.header.tensors.items():
        if (wanted is not None and name not in wanted) or not info.dtype.is_floating_point or not info.nbytes:
            continue
        if not info.shape or info.nbytes <= chunk_bytes:
            check_finite_tensor(tf.get(name, pool, "finite"), name, tf.path)
            continue
        row = math.prod(info.shape[1:]) * info.dtype.itemsize
        rows = max(1, chunk_bytes // max(row, 1))
        for lo in range(0, info.shape[0], rows):
            n = min(rows, info.shape[0] - lo)
            buf = pool.take("finite", (n, *info.shape[1:]), info.dtype)
            check_finite_tensor(tf.read_into(buf, info.begin + lo * row, name), name, tf.path)


def check_tokenizer(folder: str | os.PathLike) -> None:
    """Refuse a folder without tokenizer files (transformers would build a near-empty tokenizer from nothing).

    Its JSON files must parse (a cut or garbled ``tokenizer.json`` made transformers fail naming no file).

    Raises:
        TokenizerError: naming the folder (or the file) and the fix.
    """
    folder = Path(folder)
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise TokenizerError(
            f"{folder}: no tokenizer files (none of {', '.join(TOKENIZER_FILES)}) — copy the base model's tokenizer "
            "into the folder (tokenizer.save_pretrained(folder))"
        )
    for name in _TOKENIZER_JSON:
        if not (file := folder / name).is_file():
            continue
        ident, parsed = _PARSED.lookup(file)
        if parsed:  # a tokenizer.json of megabytes is parsed once per process while unchanged
            continue
        try:
            json.loads(file.read_bytes())
        except (ValueError, OSError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise TokenizerError(f"{file}: cannot be read as JSON ({exc}) — copy the base model's tokenizer files "
                                 "into the folder again (tokenizer.save_pretrained(folder))") from None  # fmt: skip
        _PARSED.remember(file, ident, True)


# the tokenizer's JSON files: transformers' own parse error names no file
_TOKENIZER_JSON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json")
_PARSED: FileMemo[bool] = FileMemo()  # tokenizer JSON files this process found to parse (see symfuse.io.memo)


def check_vocab_size(tokenizer: Any, folder: str | os.PathLike) -> Any:
    """Refuse a loaded tokenizer that cannot feed the folder's model.

    Refused: fewer than :data:`MIN_VOCAB` tokens (every word would be ``[UNK]``); a base vocabulary larger than the
    model's embedding table, or a padding id past it (``config.json`` ``vocab_size``): the tokenizer of another
    model, whose ids past the table fail the first batch that holds one, deep in the embedding lookup.
    """
    n = len(tokenizer)
    fix = "copy the base model's tokenizer files into the folder (tokenizer.save_pretrained(folder))"
    if n < MIN_VOCAB:
        raise TokenizerError(f"{folder}: tokenizer has only {n} tokens, so nearly every input would be [UNK] — {fix}")
    rows = _embedded_tokens(Path(folder))
    base, pad = getattr(tokenizer, "vocab_size", n), getattr(tokenizer, "pad_token_id", None)
    if rows is not None and base > rows:
        raise TokenizerError(f"{folder}: the tokenizer has {base} tokens but the model embeds {rows} (config.json "
                             f"vocab_size), so it belongs to another model — {fix}")  # fmt: skip
    if rows is not None and isinstance(pad, int) and pad >= rows:
        raise TokenizerError(f"{folder}: the tokenizer pads with token id {pad}, past the model's {rows} embeddings "
                             "(config.json vocab_size) — resize the model's embeddings to the tokenizer "
                             "(model.resize_token_embeddings(len(tokenizer))) and save it again")  # fmt: skip
    return tokenizer


def _embedded_tokens(folder: Path) -> int | None:
    """The model's embedding rows as ``config.json`` gives them (CLIP: its text tower's), or None."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None  # a tokenizer folder without a model, or a config the reader names elsewhere
    if not isinstance(config, dict):
        return None
    text = config.get("text_config")
    rows = config.get("vocab_size", text.get("vocab_size") if isinstance(text, dict) else None)
    return rows if isinstance(rows, int) and not isinstance(rows, bool) and rows > 0 else None
