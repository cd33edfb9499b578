"""Whole-model output checks: the logits of a written checkpoint against its source's, on a few short random inputs.

* :func:`streaming_logit_diff`: each model built empty (parameters on the meta device) and its layers read from disk
  just before they run and dropped right after: memory is one layer plus the embeddings and heads, never a whole
  model (let alone two). :class:`StreamedReference` computes the source's side in a background thread while matching
  runs.
* :func:`full_logit_diff`: the same with both models loaded whole (``--verify full``).
* :func:`verify_outputs`: the check a match runs on what it wrote, with the stored dtype's tolerance
  (:func:`logit_tolerance`).
"""

from __future__ import annotations

import contextlib
import logging
import zlib
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from symfuse.arch import get_spec
from symfuse.checkpoint import HF_LOAD_LOCK, CheckpointReader, load_hf_model
from symfuse.errors import VerificationError
from symfuse.io import rows_per_block
from symfuse.match.closed_form import torch_threads
from symfuse.match.forward import plain_forward, plain_forward_supported

log = logging.getLogger(__name__)
VERIFY_MODES = ("stream", "full", "none")


def logit_tolerance(dtype: torch.dtype) -> float:
    """Largest accepted max |Δ output| relative to max |output| for weights stored in ``dtype``."""
    return 1e-4 if dtype in (torch.float32, torch.float64) else 2e-2


@contextlib.contextmanager
def _params_on_meta() -> Iterator[None]:
    """Every ``nn.Parameter`` registered in the block lands on the meta device (buffers stay real)."""
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            p = module._parameters[name]
            module._parameters[name] = torch.nn.Parameter(p.to("meta"), requires_grad=False)

    torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def _model_class(config: Any) -> Any:
    import transformers

    arch = (getattr(config, "architectures", None) or [None])[0]
    return (getattr(transformers, arch, None) if arch else None) or transformers.AutoModel


def _empty_model(config: Any) -> torch.nn.Module:
    cls = _model_class(config)
    with HF_LOAD_LOCK, _params_on_meta():
        model = cls._from_config(config) if hasattr(cls, "_from_config") else cls(config)
    return model.eval()


def _layer_list(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The ModuleList holding most parameters (the stack of layers), if it has more than one child."""
    best, size = None, 0
    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) > 1:
            n = sum(p.numel() for p in m.parameters())
            if n > size:
                best, size = m, n
    return best


_Owned = list[tuple[torch.nn.Module, str, torch.nn.Parameter]]  # (module, parameter name, its meta parameter)


def _owned(m: torch.nn.Module) -> _Owned:
    """Every parameter slot of ``m`` and its submodules, tied parameters once per module that holds them."""
    return [(mod, pn, p) for mod in m.modules() for pn, p in mod._parameters.items() if p is not None]


class _StoredWeights:
    """Put ``reader``'s weights into a meta-device model's parameter slots, and take them out again.

    A parameter the checkpoint does not store (a fresh head) gets the same seeded values in every model.
    """

    def __init__(self, model: torch.nn.Module, reader: CheckpointReader):
        self.reader = reader
        base = getattr(model, "base_model_prefix", "") or ""
        self.names: dict[int, tuple[str | None, str]] = {}  # id(parameter): (stored name or None, model name)
        for n, p in model.named_parameters(remove_duplicate=False):
            if self.names.get(id(p), (None,))[0] is None:
                self.names[id(p)] = (self._stored(n, base), n)

    def _stored(self, name: str, base: str) -> str | None:
        for n in (name, name.removeprefix(base + "."), f"{base}.{name}", self.reader.prefix + name):
            if self.reader.has(n):
                return n
        return None

    def _load(self, p: torch.nn.Parameter) -> torch.nn.Parameter:
        s, full = self.names[id(p)]
        if s is None:  # not stored (a fresh head): the same seeded values in both models
            g = torch.Generator().manual_seed(zlib.crc32(full.encode()))
            t = 0.02 * torch.randn(p.shape, generator=g)
        else:
            t = self.reader.tensor_file(s).get(s)
            if t.shape != p.shape:
                shape = tuple(t.shape)
                raise VerificationError(f"{self.reader.path}: {s} has shape {shape}, the model wants {p.shape}")
            t = t.float() if t.is_floating_point() else t
        return torch.nn.Parameter(t, requires_grad=False)

    def fill(self, items: _Owned) -> None:
        """Load the weights of ``items`` into their slots (tied parameters are read once)."""
        done: dict[int, torch.nn.Parameter] = {}
        for mod, pn, p in items:
            if id(p) not in done:
                done[id(p)] = self._load(p)
            mod._parameters[pn] = done[id(p)]

    @staticmethod
    def empty(items: _Owned) -> None:
        """Put the meta parameters back into the slots of ``items`` (the loaded weights are freed)."""
        for mod, pn, p in items:
            mod._parameters[pn] = p


def _run_streaming(
    model: torch.nn.Module, reader: CheckpointReader, inputs: Mapping[str, torch.Tensor]
) -> torch.Tensor:
    """``model`` (built by :func:`_empty_model`) on ``inputs`` with ``reader``'s weights, one layer at a time.

    Each layer's weights are loaded by a forward pre-hook and dropped by a forward hook; the rest (embeddings,
    final norm, head) stay loaded for the whole pass. The model is left as it was built (parameters on the meta
    device).
    """
    weights = _StoredWeights(model, reader)
    skeleton = _owned(model)
    layers = _layer_list(model)
    streamed: set[int] = set()
    hooks = []
    for layer in layers if layers is not None else []:
        items = _owned(layer)
        streamed.update(id(mod) for mod, _, _ in items)
        hooks.append(layer.register_forward_pre_hook(lambda _m, _a, items=items: weights.fill(items)))
        hooks.append(layer.register_forward_hook(lambda _m, _a, _o, items=items: weights.empty(items)))
    resident = [(mod, pn, p) for mod, pn, p in skeleton if id(mod) not in streamed]
    try:
        weights.fill(resident)
        with torch.no_grad(), torch_threads(1):  # a few short sequences: one thread beats two
            out = model(**inputs)
    finally:
        for h in hooks:
            h.remove()
        weights.empty(skeleton)
        reader.close_files()
    return get_spec(model.config).main_output(out).float()  # logits (CLIP: logits_per_image), else hidden states


def _inputs(config: Any, seed: int) -> dict[str, torch.Tensor]:
    return get_spec(config).random_inputs(config, generator=torch.Generator().manual_seed(seed))


def streaming_logit_diff(a: str | Path, b: str | Path, seed: int = 0) -> tuple[float, float]:
    """``(max |Δ output|, max |output of b|)`` of two checkpoints on a few random inputs, layer by layer.

    Each model is built with its parameters on the meta device; its layers are read (``pread``, float32) just
    before they run and released right after; the embeddings and heads stay for the model's pass.
    """
    with CheckpointReader(b) as rb:
        inputs = _inputs(rb.config, seed)
        model = _empty_model(rb.config)  # one skeleton serves both (a's config must build the same model)
        ob = _run_streaming(model, rb, inputs)
    with CheckpointReader(a) as ra:
        oa = _run_streaming(model, ra, inputs)
    return float((oa - ob).abs().max()), float(ob.abs().max())


def check_copied(source: CheckpointReader, matched: CheckpointReader, block: int = 1 << 22) -> None:
    """Every tensor outside the attention / FFN modules equals SOURCE's bit for bit (the match command copies them).

    The plain forward's check reads only the embedding rows its inputs use and no task head; this covers the rest.
    Read in row blocks of about ``block`` elements.

    Raises:
        VerificationError: a tensor differs, or changed shape or dtype.
    """
    owned = source.tensor_owners()
    for name in source.names():
        if name in owned:
            continue
        fs = source.tensor_file(name)
        fm = matched.tensor_file(name) if matched.has(name) else None
        info = fs.info(name)
        if fm is None or (fm.info(name).shape, fm.info(name).dtype) != (info.shape, info.dtype):
            raise VerificationError(
                f"{matched.path}: {name} is missing or changed shape / dtype; nothing was published"
            )
        n = info.shape[0] if info.shape else 1
        step = rows_per_block(info.shape, block)
        for lo in range(0, n, step):
            a, b = fs.get_rows(name, lo, lo + step), fm.get_rows(name, lo, lo + step)
            if not torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
                raise VerificationError(
                    f"{matched.path}: {name} differs from {source.path}'s, which the match command only copies — "
                    "the written checkpoint is damaged; nothing was published"
                )


class StreamedReference:
    """SOURCE's outputs for the streamed check, computed in a background thread.

    Where the family has a plain forward (:func:`symfuse.match.forward.plain_forward_supported`) and ``plain``
    holds, SOURCE runs through it in the background while :meth:`compare` runs the matched model through it in the
    calling thread (one torch thread each), and their last hidden states are compared: no transformers model is
    built (its modelling code alone costs ~2.3 s and ~140 MiB to import). Otherwise the transformers skeleton is
    built and SOURCE streamed through it in the background; :meth:`compare` then streams the matched model through
    the same skeleton on the same inputs.

    Args:
        source: The source checkpoint folder.
        seed: Seed of the random inputs.
        plain: Allow the plain forward (only for transforms that leave the residual stream as it is: its output
            is the last hidden state, not the logits).
    """

    def __init__(self, source: str | Path, seed: int = 0, plain: bool = True):
        self._source, self._seed, self._plain = Path(source), seed, plain
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="symfuse-verify")
        self._result = self._thread.submit(self._reference, Path(source), seed, plain)

    @staticmethod
    def _reference(source: Path, seed: int, plain: bool) -> tuple[torch.nn.Module | None, dict, torch.Tensor]:
        with CheckpointReader(source) as r, torch_threads(1):
            inputs = _inputs(r.config, seed)
            if plain and plain_forward_supported(r.spec, r.config):
                return None, inputs, plain_forward(r, inputs)
            model = _empty_model(r.config)
            return model, inputs, _run_streaming(model, r, inputs)

    def compare(self, matched: str | Path) -> tuple[float, float]:
        """``(max |Δ output|, max |SOURCE output|)`` of ``matched`` against SOURCE (:func:`streaming_logit_diff`)."""
        with CheckpointReader(matched) as r, torch_threads(1):
            out = None
            if self._plain and plain_forward_supported(r.spec, r.config):  # beside SOURCE's pass
                out = plain_forward(r, _inputs(r.config, self._seed))
            model, inputs, ref = self._result.result()
            if model is not None:
                out = _run_streaming(model, r, inputs)
            else:  # the hidden states do not see the heads nor most embedding rows: those must be SOURCE's copies
                with CheckpointReader(self._source) as src:
                    check_copied(src, r)
        return float((out - ref).abs().max()), float(ref.abs().max())

    def close(self) -> None:
        """Wait for the background pass (its errors surface in :meth:`compare`) and stop the thread."""
        self._thread.shutdown(wait=True)


def full_logit_diff(a: str | Path, b: str | Path, seed: int = 0) -> tuple[float, float]:
    """Like :func:`streaming_logit_diff` with both models loaded whole (float32)."""
    ma = load_hf_model(a, dtype=torch.float32, validate=False)
    mb = load_hf_model(b, dtype=torch.float32, validate=False)
    inputs = _inputs(ma.config, seed)
    with torch.no_grad():
        oa, ob = ma(**inputs), mb(**inputs)
    spec = get_spec(ma.config)
    ya, yb = spec.main_output(oa).float(), spec.main_output(ob).float()
    return float((ya - yb).abs().max()), float(yb.abs().max())


def measure_outputs(matched: Path, source: Path, mode: str, reference: StreamedReference | None = None) -> tuple:
    """``(max |Δ output|, max |output|)`` of ``matched`` against ``source`` (``mode``: stream or full).

    ``reference``: SOURCE's streamed outputs, already under way (``stream`` only).
    """
    if mode == "stream" and reference is not None:
        return reference.compare(matched)
    return (full_logit_diff if mode == "full" else streaming_logit_diff)(matched, source)


def within_tolerance(matched: Path, source: Path, diff: float, scale: float, dtype: torch.dtype, exact: bool) -> bool:
    """Whether ``diff`` is within :func:`logit_tolerance` of ``scale``; an ``exact`` alignment outside it is refused.

    Raises:
        VerificationError: ``exact`` and the outputs differ by more than the tolerance (or are NaN).
    """
    tol = logit_tolerance(dtype) * scale + 1e-6
    if exact and not diff <= tol:
        raise VerificationError(
            f"{matched}: its outputs differ from {source}'s by {diff:.2e} (max |output| {scale:.2e}, allowed "
            f"{tol:.1e}) on random inputs — the matched model does not compute the source's function; nothing was "
            "published"
        )
    return bool(diff <= tol)


def verify_outputs(
    matched: Path,
    source: Path,
    mode: str,
    dtype: torch.dtype,
    reference: StreamedReference | None = None,
    exact: bool = True,
) -> float | None:
    """Compare the outputs of ``matched`` and ``source`` (``mode``: stream, full or none); the max |Δ|.

    ``reference``: SOURCE's streamed outputs, already under way (``stream`` only). ``exact=False`` (a soft
    alignment such as OT's transport maps, which changes the function by design): the difference is measured and
    returned, never refused.

    Raises:
        VerificationError: the outputs differ by more than :func:`logit_tolerance` allows (or are NaN).
    """
    if mode == "none":
        return None
    diff, scale = measure_outputs(matched, source, mode, reference)
    within_tolerance(matched, source, diff, scale, dtype, exact)
    log.info("checked %s (%s, %s): max |Δ output| %.2e", matched, mode, "exact" if exact else "soft", diff)
    return diff
