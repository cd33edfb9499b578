"""Checks that a matched model still computes its source's function, cheap enough to run on every match.

* :func:`check_module_transform`: while a module's transform is applied, the invariants it must keep are
  compared on a few random probe inputs (float64 for float32 / float64 weights): per query head the scores
  ``(Q_h x + b) . (K_g y + b)`` (and the DeBERTa ``pos_q`` / ``pos_k`` cross terms; under RoPE also with the
  keys turned by a fixed pair rotation, which only RoPE-commuting QK maps keep), per head the output
  contribution ``O_h (V_g x + b)``, and for the FFN ``down act(up x + b)`` (gated: ``act(gate x) * up x``).
  Attention permutations must keep them to float64 rounding, rotations, scalings and invertible maps to a few units
  of the stored dtype's rounding (times the maps' condition number); the FFN (permutations; computed in float32
  without copies) to 1e-4. A failure is a :class:`~symfuse.errors.VerificationError` naming the module and head.
* :func:`streaming_logit_diff`: the outputs of two checkpoints on a few short random inputs, with each model
  built empty (parameters on the meta device) and its layers read from disk just before they run and dropped
  right after: memory is one layer plus the embeddings and heads, never a whole model (let alone two).
  :class:`StreamedReference` computes the source's side in a background thread while matching runs.
* :func:`full_logit_diff`: the same with both models loaded whole (``--verify full``).
"""

from __future__ import annotations

import contextlib
import logging
import zlib
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from symfuse.arch import Geometry, ModuleRef, get_spec
from symfuse.checkpoint import HF_LOAD_LOCK, CheckpointReader, load_hf_model
from symfuse.errors import VerificationError
from symfuse.io import rows_per_block
from symfuse.match.closed_form import torch_threads
from symfuse.match.forward import plain_forward, plain_forward_supported
from symfuse.symmetry.registry import kind_of_part
from symfuse.symmetry.transforms import FFNPermutation, HeadPermutation, ModuleTransform

log = logging.getLogger(__name__)

VERIFY_MODES = ("stream", "full", "none")
N_PROBES = 4
EXACT_TOL = 1e-9  # permutations only: the probes differ by float64 summation order alone
FLOAT32_TOL = 1e-4  # checks computed in float32: its summation-order noise over a few thousand terms
ROUNDING_TOL = 16  # rotations / scalings: units of the stored dtype's epsilon


def _tol(mt: ModuleTransform | None, weights: Mapping[str, torch.Tensor]) -> float:
    if mt is None or all(isinstance(p, (FFNPermutation, HeadPermutation)) for p in mt.parts):
        return EXACT_TOL
    eps = max(torch.finfo(t.dtype).eps for t in weights.values() if t.is_floating_point())
    # an invertible map M rounds the stored weights relative to |M x|, which may exceed |x| by cond(M)
    return ROUNDING_TOL * eps * max(p.condition() for p in mt.parts)


def _work(weights: Mapping[str, torch.Tensor]) -> torch.dtype:
    half = any(t.dtype in (torch.float16, torch.bfloat16) for t in weights.values())
    return torch.float32 if half else torch.float64


def _proj(w: Mapping[str, torch.Tensor], role: str, x: torch.Tensor) -> torch.Tensor:
    y = w[role].to(x.dtype) @ x
    b = w.get(role + "_bias")
    return y + b.to(x.dtype)[:, None] if b is not None else y


def _rel(new: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Relative Frobenius change per leading index (NaN counts as a failure)."""
    d = (new - ref).flatten(1).norm(dim=1)
    return d / ref.flatten(1).norm(dim=1).clamp_min(torch.finfo(ref.dtype).tiny)


def _attn_invariants(w: Mapping[str, torch.Tensor], geo: Geometry, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per head: QK scores (each q-side x k-side role pair) and the V/O output contribution, on probes ``x``."""
    nh, nkv, dh, p = geo.n_heads, geo.n_kv_heads, geo.head_dim, x.shape[1]
    y = x.flip(1)  # second probe set for the key side
    group = torch.arange(nh, device=x.device) // (nh // nkv)
    out = {}
    for qr in ("q", "pos_q"):
        for kr in ("k", "pos_k"):
            if qr in w and kr in w:
                q = _proj(w, qr, x).reshape(nh, dh, p)
                k = _proj(w, kr, y).reshape(nkv, dh, p)[group]
                out[f"{qr}.{kr} scores"] = torch.einsum("hdp,hdr->hpr", q, k)
                if geo.rope and qr == "q" and kr == "k":  # the keys at another position: RoPE between q and k
                    out["q.k scores across positions"] = torch.einsum("hdp,hdr->hpr", q, _rope_turn(k))
    v = _proj(w, "v", x).reshape(nkv, dh, p)[group]  # (nh, dh, p)
    o = w["o"].to(x.dtype).reshape(w["o"].shape[0], nh, dh)
    out["V.O output"] = torch.einsum("ehd,hdp->hep", o, v)
    return out


def _rope_turn(k: torch.Tensor) -> torch.Tensor:
    """``k`` (heads, dh, probes) turned by a fixed RoPE-like rotation: angle ``0.7 (i + 1)`` on pair ``(i, i + dh/2)``.

    A QK map keeps ``q^T R k`` for every such rotation ``R`` only if it commutes with them (a scaled rotation per
    pair): the check then sees a map that RoPE does not allow, which the plain scores do not.
    """
    h = k.shape[1] // 2
    angle = 0.7 * torch.arange(1, h + 1, dtype=k.dtype, device=k.device)[None, :, None]
    c, s = torch.cos(angle), torch.sin(angle)
    a, b = k[:, :h], k[:, h:]
    return torch.cat([c * a - s * b, s * a + c * b], dim=1)


def _ffn_invariant(w: Mapping[str, torch.Tensor], x: torch.Tensor) -> dict[str, torch.Tensor]:
    h = torch.tanh(_proj(w, "up", x))
    if "gate" in w:
        h = h * torch.tanh(_proj(w, "gate", x))
    return {"FFN output": (w["down"].to(x.dtype) @ h)[None]}


def _head_order(transform: ModuleTransform | None, geo: Geometry) -> torch.Tensor:
    """New query head j = old query head ``order[j]`` (the head permutations of ``transform``, composed)."""
    groups = torch.arange(geo.n_kv_heads)
    for p in transform.parts if transform is not None else ():
        if isinstance(p, HeadPermutation):
            groups = groups[p.perm.cpu()]
    g = geo.n_heads // geo.n_kv_heads
    return (groups[:, None] * g + torch.arange(g)[None, :]).reshape(-1)


def is_exact(transform: ModuleTransform) -> bool:
    """Whether every part of ``transform`` comes from an exact symmetry kind (unregistered parts count as exact).

    A part of an inexact kind (OT's soft transport maps) changes the module's function by design: it is not
    held to :func:`check_module_transform`'s invariants.
    """
    kinds = [kind_of_part(p.name) for p in transform.parts]
    return all(k is None or k.exact for k in kinds)


@dataclass(frozen=True)
class ModuleInvariants:
    """What :func:`check_module_transform` compares, taken from a module before its transform.

    Attributes:
        roles: Each role's shape and dtype.
        values: The invariants on the probes (per head / per FFN).
        dtype: The probes' dtype.
    """

    roles: dict[str, tuple[tuple[int, ...], torch.dtype]]
    values: dict[str, torch.Tensor]
    dtype: torch.dtype


def _invariants(ref: ModuleRef, w: Mapping[str, torch.Tensor], geo: Geometry, dtype: torch.dtype) -> dict:
    g = torch.Generator().manual_seed(1234 + 2 * ref.layer + (ref.kind == "ffn"))
    device = next(iter(w.values())).device  # the probes are drawn on the CPU: the same on every device
    x = torch.randn(geo.d_model, N_PROBES, generator=g, dtype=dtype).to(device)
    return _attn_invariants(w, geo, x) if ref.kind == "attn" else _ffn_invariant(w, x)


def module_invariants(ref: ModuleRef, weights: Mapping[str, torch.Tensor], geo: Geometry) -> ModuleInvariants:
    """A module's invariants before its transform, so the weights can be freed before the transformed ones are checked.

    Args:
        ref: The module.
        weights: Its canonical weights.
        geo: Model geometry (heads, head size).
    """
    geo = geo.of(ref.stack)  # multi-stack families (T5, CLIP): the module's own stack
    # attention in float64 (rotations are checked to the stored dtype's rounding); the FFN (permutations only,
    # the big matrices) in float32 without copies, to float32 summation-order noise
    dtype = _work(weights) if ref.kind == "attn" else torch.float32
    roles = {role: (tuple(t.shape), t.dtype) for role, t in weights.items()}
    return ModuleInvariants(roles, _invariants(ref, weights, geo, dtype), dtype)


def check_module_transform(
    ref: ModuleRef,
    old: Mapping[str, torch.Tensor] | ModuleInvariants,
    new: Mapping[str, torch.Tensor],
    geo: Geometry,
    transform: ModuleTransform | None = None,
    where: str = "",
) -> float:
    """Check that ``new`` (the transformed module) computes what ``old`` does, on random probes.

    Args:
        ref: The module.
        old: Its canonical weights before the transform, or their :func:`module_invariants`.
        new: After the transform, in the stored dtype.
        geo: Model geometry (heads, head size).
        transform: The transform applied (permutations alone are held to float64 rounding).
        where: Names the artifact in the error (e.g. the output folder).

    Returns:
        The largest relative change seen (per head / per FFN, Frobenius over probes).

    Raises:
        VerificationError: a role missing or changed in shape / dtype, or an invariant broken beyond rounding.
    """
    before = old if isinstance(old, ModuleInvariants) else module_invariants(ref, old, geo)
    geo = geo.of(ref.stack)
    prefix = f"{where}: " if where else ""
    for role, (shape, dtype) in before.roles.items():
        if role not in new or tuple(new[role].shape) != shape or new[role].dtype != dtype:
            got = (tuple(new[role].shape), new[role].dtype) if role in new else None
            raise VerificationError(
                f"{prefix}module {ref.key}: role {role!r} is {got} after the transform, {(shape, dtype)} "
                "before — the transform is not a symmetry of this module; nothing was published"
            )
    after = _invariants(ref, new, geo, before.dtype)
    tol = max(_tol(transform, new), FLOAT32_TOL if before.dtype == torch.float32 else 0.0)
    heads = _head_order(transform, geo) if ref.kind == "attn" else None
    worst = 0.0
    for what, b in before.values.items():
        rel = _rel(after[what], b if heads is None else b[heads.to(b.device)])
        bad = ~(rel <= tol)
        if bool(bad.any()):
            h = int(bad.nonzero()[0, 0])
            head = f" head {h}" if ref.kind == "attn" else ""
            raise VerificationError(
                f"{prefix}module {ref.key}: the transform changes the {what}{head} by {float(rel[h]):.1e} "
                f"(relative; rounding allows {tol:.0e}) — the matched weights are wrong; nothing was published"
            )
        worst = max(worst, float(rel.max()))
    return worst


# ----------------------------------------------------------------------------------------- model outputs
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


def _run_streaming(
    model: torch.nn.Module, reader: CheckpointReader, inputs: Mapping[str, torch.Tensor]
) -> torch.Tensor:
    """``model`` (built by :func:`_empty_model`) on ``inputs`` with ``reader``'s weights, one layer at a time.

    The model is left as it was built (parameters on the meta device).
    """
    base = getattr(model, "base_model_prefix", "") or ""

    def stored(name: str) -> str | None:
        for n in (name, name.removeprefix(base + "."), f"{base}.{name}", reader.prefix + name):
            if reader.has(n):
                return n
        return None

    names: dict[int, tuple[str | None, str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        if names.get(id(p), (None,))[0] is None:
            names[id(p)] = (stored(n), n)

    def load(p: torch.nn.Parameter) -> torch.nn.Parameter:
        s, full = names[id(p)]
        if s is None:  # not stored (a fresh head): the same seeded values in both models
            g = torch.Generator().manual_seed(zlib.crc32(full.encode()))
            t = 0.02 * torch.randn(p.shape, generator=g)
        else:
            t = reader.tensor_file(s).get(s)
            if t.shape != p.shape:
                raise VerificationError(f"{reader.path}: {s} has shape {tuple(t.shape)}, the model wants {p.shape}")
            t = t.float() if t.is_floating_point() else t
        return torch.nn.Parameter(t, requires_grad=False)

    Owned = list[tuple[torch.nn.Module, str, torch.nn.Parameter]]

    def owned(m: torch.nn.Module) -> Owned:
        return [(mod, pn, p) for mod in m.modules() for pn, p in mod._parameters.items() if p is not None]

    def fill(items: Owned) -> None:
        done: dict[int, torch.nn.Parameter] = {}  # tied parameters are read once
        for mod, pn, p in items:
            if id(p) not in done:
                done[id(p)] = load(p)
            mod._parameters[pn] = done[id(p)]

    def empty(items: Owned) -> None:
        for mod, pn, p in items:
            mod._parameters[pn] = p

    skeleton = owned(model)
    layers = _layer_list(model)
    streamed: set[int] = set()
    hooks = []
    if layers is not None:
        for layer in layers:
            items = owned(layer)
            streamed.update(id(mod) for mod, _, _ in items)
            hooks.append(layer.register_forward_pre_hook(lambda _m, _a, items=items: fill(items)))
            hooks.append(layer.register_forward_hook(lambda _m, _a, _o, items=items: empty(items)))
    resident = [(mod, pn, p) for mod, pn, p in owned(model) if id(mod) not in streamed]
    try:
        fill(resident)
        with torch.no_grad(), torch_threads(1):  # a few short sequences: one thread beats two
            out = model(**inputs)
    finally:
        for h in hooks:
            h.remove()
        empty(skeleton)
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
