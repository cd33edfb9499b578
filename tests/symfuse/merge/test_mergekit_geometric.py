"""mergekit's geometric / selection methods: closed forms on small tensors, one-line refusals, one CLI merge."""

import math

import pytest
import torch
from safetensors.torch import load_file

from symfuse.errors import UsageError
from symfuse.merge import MERGERS, TensorInputs, merge_checkpoints, merger_params
from symfuse.merge.arcee_fusion import arcee_fusion, fusion_importance
from symfuse.merge.gradient import evaluate_setting, layer_count, layer_index, layer_position
from symfuse.merge.karcher import karcher_mean
from symfuse.merge.model_stock import model_stock
from symfuse.merge.multislerp import multislerp
from symfuse.merge.nearswap import nearswap
from symfuse.merge.nuslerp import nuslerp, nuslerp_t
from symfuse.merge.slerp import lerp, slerp
from tests.cli.helpers import assert_merge_refused, run_cli
from tests.tiny import save_tiny, save_tiny_text_classifier

D = torch.float64


def _unit(*entries: float) -> torch.Tensor:
    v = torch.tensor(entries, dtype=D)
    return v / v.norm()


def _ortho(n: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Two orthogonal unit vectors of length n."""
    q, _ = torch.linalg.qr(torch.randn(n, 2, dtype=D, generator=torch.Generator().manual_seed(seed)))
    return q[:, 0].clone(), q[:, 1].clone()


def _inputs(*xs: torch.Tensor, weights=None, base=None, name: str = "w") -> TensorInputs:
    w = weights or [1 / len(xs)] * len(xs)
    return TensorInputs(name, list(xs), w, base=base)


# ------------------------------------------------------------------------------------------------- slerp


@pytest.mark.parametrize("t", [0.0, 0.25, 0.5, 0.9, 1.0])
def test_slerp_of_orthogonal_vectors_has_cos_sin_weights(t):
    e1, e2 = _ortho()
    want = math.cos(t * math.pi / 2) * e1 + math.sin(t * math.pi / 2) * e2
    torch.testing.assert_close(slerp(t, e1, e2), want)
    torch.testing.assert_close(slerp(t, 3 * e1, 2 * e2), 3 * math.cos(t * math.pi / 2) * e1
                               + 2 * math.sin(t * math.pi / 2) * e2)  # fmt: skip  # the norms are kept


def test_slerp_end_points_and_dtype():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(5, 7, generator=g), torch.randn(5, 7, generator=g)
    torch.testing.assert_close(slerp(0.0, a, b), a)
    torch.testing.assert_close(slerp(1.0, a, b), b)
    out = slerp(0.3, a.bfloat16(), b.bfloat16())
    assert out.dtype == torch.bfloat16 and out.shape == (5, 7)


def test_slerp_of_near_parallel_or_antiparallel_vectors_is_linear():
    g = torch.Generator().manual_seed(2)
    a = torch.randn(64, dtype=D, generator=g)
    b = 2 * a + 1e-3 * torch.randn(64, dtype=D, generator=g)  # cos > 0.9995
    assert torch.equal(slerp(0.3, a, b), lerp(0.3, a, b))
    assert torch.equal(slerp(0.3, a, -a), lerp(0.3, a, -a))
    c = a + 0.5 * torch.randn(64, dtype=D, generator=g)  # well apart: not linear
    assert not torch.allclose(slerp(0.3, a, c), lerp(0.3, a, c))


def test_slerp_merger_first_model_is_t0_and_t_reads_a_layer_gradient():
    e1, e2 = _ortho()
    m = MERGERS["slerp"](t=0.25)
    torch.testing.assert_close(m.merge_tensor(_inputs(e1, e2)), slerp(0.25, e1, e2))
    g = MERGERS["slerp"](t=[0.0, 1.0])
    with pytest.raises(ValueError, match="slerp t: a list"):
        g.merge_tensor(_inputs(e1, e2, name="bert.encoder.layer.1.output.dense.weight"))
    g.gradient.n_layers = 3  # layers 0, 1, 2 at positions 0, 0.5, 1; outside the stack: 0
    at = {"bert.embeddings.word_embeddings.weight": 0.0, "bert.encoder.layer.0.x": 0.0, "classifier.weight": 0.0}
    at |= {"bert.encoder.layer.1.x": 0.5, "bert.encoder.layer.2.x": 1.0}
    for name, t in at.items():
        torch.testing.assert_close(g.merge_tensor(_inputs(e1, e2, name=name)), slerp(t, e1, e2), msg=name)


def test_gradient_reads_mergekit_positions():
    assert evaluate_setting([0, 0.5, 1], 0.25) == pytest.approx(0.25)
    assert evaluate_setting([0.2, 0.8], 1.0) == pytest.approx(0.8)
    assert evaluate_setting([1.0, 0.0, 1.0], 0.5) == 0.0 and evaluate_setting(0.7, 0.3) == 0.7
    names = ["model.layers.0.mlp.w", "model.layers.11.mlp.w", "transformer.h.3.attn.w", "lm_head.weight"]
    assert [layer_index(n) for n in names] == [0, 11, 3, None] and layer_count(names) == 12
    assert layer_position("model.layers.11.x", 12) == 1.0 and layer_position("model.layers.0.x", 1) == 1.0
    assert layer_position("model.embed_tokens.weight", 12) == 0.0
    assert layer_index("albert.encoder.albert_layer_groups.0.albert_layers.0.ffn.weight") is None


def test_slerp_and_nearswap_params_are_checked_in_one_line():
    assert merger_params("slerp", {"t": [0, 0.5, 1]}).t == [0.0, 0.5, 1.0]
    for value, msg in [(2, "2 is not in [0, 1]"), ([0, 1.5], "1.5 is not in [0, 1]"), ([], "an empty list"),
                       ("x", "'x' is not a number")]:  # fmt: skip
        with pytest.raises(ValueError, match=r"^t: ") as err:
            merger_params("slerp", {"t": value})
        assert msg in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"^weights: this strategy takes no model weights"):
        merger_params("slerp", {"weights": [1, 2]})
    with pytest.raises(ValueError, match="t: missing — strategy nearswap needs it"):
        merger_params("nearswap", {})


# ------------------------------------------------------------------------------------------------- nuslerp


def test_nuslerp_flattened_is_slerp_and_t_comes_from_the_weights():
    e1, e2 = _ortho(12)
    a, b = e1.view(3, 4), e2.view(3, 4)
    torch.testing.assert_close(nuslerp(0.3, a, b, flatten=True), slerp(0.3, a, b))
    assert nuslerp_t([1.0, 3.0]) == 0.75 and nuslerp_t([1.0, -1.0]) == 0.5
    m = MERGERS["nuslerp"](weights=[1.0, 3.0])
    torch.testing.assert_close(m.merge_tensor(_inputs(a, b, weights=[0.25, 0.75])), slerp(0.75, a, b))
    base = torch.full((3, 4), 0.5, dtype=D)
    out = m.merge_tensor(_inputs(base + a, base + b, weights=[0.25, 0.75], base=base))
    torch.testing.assert_close(out, base + slerp(0.75, a, b))  # with a base: slerp of the task vectors


def test_nuslerp_row_and_column_wise():
    x = torch.tensor([[1.0, 0.0], [2.0, 0.0]], dtype=D)
    y = torch.tensor([[0.0, 1.0], [4.0, 0.0]], dtype=D)  # row 0 orthogonal, row 1 parallel
    c, s = math.cos(math.pi / 4), math.sin(math.pi / 4)
    rows = nuslerp(0.5, x, y, dim=-1)
    torch.testing.assert_close(rows, torch.tensor([[c, s], [3.0, 0.0]], dtype=D))
    cols = nuslerp(0.5, x.T, y.T, dim=0)  # the same vectors, stored as columns
    torch.testing.assert_close(cols, rows.T)
    m = MERGERS["nuslerp"](nuslerp_flatten=False, nuslerp_row_wise=True)
    torch.testing.assert_close(m.merge_tensor(_inputs(x.T.contiguous(), y.T.contiguous())), rows.T)


# ------------------------------------------------------------------------------------------------- multislerp


def test_multislerp_one_hot_weight_returns_that_model():
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(4, 5, dtype=D, generator=g) for _ in range(3)]
    torch.testing.assert_close(multislerp(xs, [0.0, 1.0, 0.0]), xs[1])
    base = torch.randn(4, 5, dtype=D, generator=g)
    torch.testing.assert_close(multislerp(xs, [0.0, 0.0, 2.0], base=base), xs[2])


def test_multislerp_of_two_is_the_slerp_midpoint_and_weights_may_stay_unnormalised():
    e1, e2 = _ortho()
    torch.testing.assert_close(multislerp([e1, e2], [0.5, 0.5]), slerp(0.5, e1, e2))
    torch.testing.assert_close(multislerp([e1, e2], [2.0, 0.0], normalize_weights=False), 2 * e1)
    m = MERGERS["multislerp"](weights=[2.0, 0.0], normalize_weights=False)
    torch.testing.assert_close(m.merge_tensor(_inputs(e1, e2, weights=[1.0, 0.0])), 2 * e1)


def test_multislerp_cancelling_directions():
    e1, e2 = _ortho()
    torch.testing.assert_close(multislerp([e1, -e1], [0.5, 0.5]), torch.zeros_like(e1))  # two: linear
    with pytest.raises(ValueError, match="weighted sum of the unit tensors is zero"):
        multislerp([e1, -e1, e2], [0.5, 0.5, 0.0])
    one = torch.ones(3, dtype=D)  # three models equal to the base: zero task vectors, the base (mergekit raises)
    assert torch.equal(multislerp([one, one, one], [1 / 3] * 3, base=one), one)


# ------------------------------------------------------------------------------------------------- karcher


def test_karcher_of_two_unit_points_is_the_slerp_midpoint():
    e1, e2 = _ortho()
    torch.testing.assert_close(karcher_mean([e1, e2], [0.5, 0.5]), slerp(0.5, e1, e2))
    u, v = _unit(1, 2, 3, 4), _unit(4, -1, 0, 2)
    torch.testing.assert_close(karcher_mean([u, v], [0.5, 0.5]), slerp(0.5, u, v))
    out = karcher_mean([2 * u, 4 * v], [0.5, 0.5])  # the norms are averaged: 3, along the same direction
    torch.testing.assert_close(out, 3 * slerp(0.5, u, v))
    m = MERGERS["karcher"]()
    torch.testing.assert_close(m.merge_tensor(_inputs(u, v)), slerp(0.5, u, v))


def test_karcher_of_one_direction_and_of_zeros():
    u = _unit(1, 1, 0)
    torch.testing.assert_close(karcher_mean([u, 3 * u, 5 * u], [1 / 3] * 3), 3 * u)
    z = torch.zeros(3, dtype=D)
    assert torch.equal(karcher_mean([z, z], [0.5, 0.5]), z)
    torch.testing.assert_close(karcher_mean([z, 4 * u], [0.5, 0.5]), 2 * u)  # a zero tensor counts in the norm


# ------------------------------------------------------------------------------------------------- model stock


def test_model_stock_ratio_from_the_task_vector_angle():
    g = torch.Generator().manual_seed(4)
    base = torch.randn(16, dtype=D, generator=g)
    e1, e2 = _ortho()
    torch.testing.assert_close(model_stock([base + e1, base + e1], base), base + e1)  # identical: the fine-tuned
    torch.testing.assert_close(model_stock([base + e1, base + e2], base), base)  # orthogonal: t = 0, the base
    w2 = 0.5 * e1 + math.sqrt(3) / 2 * e2  # cos = 1/2: t = 2 (1/2) / (1 + 1/2) = 2/3
    want = 2 / 3 * (base + (e1 + w2) / 2) + 1 / 3 * base
    torch.testing.assert_close(model_stock([base + e1, base + w2], base), want)
    m = MERGERS["model-stock"]()
    torch.testing.assert_close(m.merge_tensor(_inputs(base + e1, base + w2, base=base)), want)


def test_model_stock_filter_wise_has_one_ratio_per_row():
    e1, e2 = _ortho(4)
    base = torch.zeros(2, 4, dtype=D)
    a = torch.stack([e1, e1])
    b = torch.stack([e1, e2])  # row 0: identical task vectors (t = 1), row 1: orthogonal (t = 0)
    out = model_stock([a, b], base, filter_wise=True)
    torch.testing.assert_close(out, torch.stack([e1, torch.zeros(4, dtype=D)]))
    flat = model_stock([a, b], base)  # one cosine for the whole tensor: 1/2, t = 2/3
    torch.testing.assert_close(flat, 2 / 3 * (a + b) / 2)


# ------------------------------------------------------------------------------------------------- nearswap, fusion


def test_nearswap_moves_each_entry_at_most_t_towards_the_second_model():
    a = torch.zeros(4, dtype=D)
    b = torch.tensor([0.05, 0.1, 0.5, -2.0], dtype=D)
    torch.testing.assert_close(nearswap(0.1, a, b), torch.tensor([0.05, 0.1, 0.1, -0.1], dtype=D))
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(6, 6, dtype=D, generator=g), torch.randn(6, 6, dtype=D, generator=g)
    torch.testing.assert_close(nearswap(0.3, x, y), x + (y - x).clamp(-0.3, 0.3))  # the closed form
    m = MERGERS["nearswap"](t=0.3)
    torch.testing.assert_close(m.merge_tensor(_inputs(x, y)), x + (y - x).clamp(-0.3, 0.3))


def test_arcee_fusion_keeps_only_the_outlying_changes():
    g = torch.Generator().manual_seed(6)
    a = torch.randn(100, dtype=D, generator=g)
    d = torch.cat([torch.arange(1, 99, dtype=D) / 100, torch.tensor([5.0, 6.0], dtype=D)])
    d = d[torch.randperm(100, generator=g)]
    b = a + d  # importance = |d| * KL (one value for a 1-D tensor): median 0.50, IQR 0.50, threshold 1.25 KL
    out = arcee_fusion(a, b)
    big = d > 1
    torch.testing.assert_close(out[big], b[big])
    assert torch.equal(out[~big], a[~big])
    m = MERGERS["arcee-fusion"]()
    assert torch.equal(m.merge_tensor(_inputs(a, b)), out)


def test_arcee_fusion_importance_is_per_row():
    a = torch.zeros(2, 3, dtype=D)
    b = torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]], dtype=D)  # row 0 unchanged: KL 0, importance 0
    imp = fusion_importance(b, a)
    assert torch.equal(imp[0], torch.zeros(3, dtype=D)) and imp[1, 0] > 0 and imp[1, 1] == 0


# ------------------------------------------------------------------------------------------------- refusals


def test_model_counts_are_refused_in_one_line():
    e1, e2 = _ortho()
    for name in ("slerp", "nuslerp", "nearswap", "arcee-fusion"):
        kw = {"t": 0.1} if name == "nearswap" else {}
        with pytest.raises(UsageError) as err:
            MERGERS[name](**kw).merge_tensor(_inputs(e1, e2, e1))
        assert str(err.value) == f"--models: 3 model(s) given — {name} merges exactly two: --models A B"
        assert torch.equal(MERGERS[name](**kw).merge_tensor(_inputs(e1)), e1)  # one model's part: mergekit keeps it
    with pytest.raises(UsageError, match=r"^--models: 2 model.s. given — passthrough merges exactly one: --models A$"):
        MERGERS["passthrough"].check_model_count(2)
    with pytest.raises(UsageError, match=r"^--models: 1 model.s. given — give two or more: --models A B \[C ...\]$"):
        MERGERS["karcher"].check_model_count(1)


def test_library_refuses_a_wrong_model_count_before_reading(tmp_path):
    a, b = save_tiny(tmp_path / "a", "bert", seed=1), save_tiny(tmp_path / "b", "bert", seed=2)
    with pytest.raises(UsageError, match="slerp merges exactly two"):
        merge_checkpoints("slerp", [a, b, a], tmp_path / "out")
    assert not (tmp_path / "out").exists()
    out = merge_checkpoints("passthrough", [a], tmp_path / "p", scale=2.0)
    got, want = load_file(out / "model.safetensors"), load_file(a / "model.safetensors")
    assert all(torch.equal(got[k], want[k] * 2 if want[k].is_floating_point() else want[k]) for k in want)
    grad = merge_checkpoints("slerp", [a, b], tmp_path / "g", t=[0.0, 1.0])  # tiny BERT: two layers, at 0 and 1
    got, wb = load_file(grad / "model.safetensors"), load_file(b / "model.safetensors")
    for k in want:
        end = wb if ".layer.1." in k else want
        torch.testing.assert_close(got[k], end[k], msg=k)


@pytest.mark.parametrize(
    ("strategy", "args", "expect"),
    [
        ("slerp", "--models {A} {B} {A}", "--models: 3 model(s) given — slerp merges exactly two: --models A B"),
        ("slerp", "--models {A} {B} --base {A}", "--base: --strategy slerp does not use a base model"),
        ("nearswap", "--models {A} {B}", "--param t: missing — strategy nearswap needs it"),
        ("slerp", "--models {A} {B} --param t=[0,2]", "--param t: 2 is not in [0, 1]"),
    ],
)
def test_cli_refusals_are_one_line(tmp_path, strategy, args, expect):
    assert_merge_refused(tmp_path, strategy, args, 2, expect)


def test_cli_slerp_merges_two_tiny_checkpoints(tmp_path):
    a, b = save_tiny_text_classifier(tmp_path / "a", seed=0), save_tiny_text_classifier(tmp_path / "b", seed=1)
    res = run_cli("merge", "--strategy", "slerp", "--models", a, b, "--param", "t=0.3", "--out", tmp_path / "m")
    assert res.returncode == 0, res.stderr
    got, wa, wb = (load_file(p / "model.safetensors") for p in (tmp_path / "m", a, b))
    assert got.keys() == wa.keys()
    for k, x in wa.items():
        want = slerp(0.3, x, wb[k]) if x.is_floating_point() else x
        torch.testing.assert_close(got[k], want, msg=k)
    assert any(not torch.allclose(got[k], wa[k]) for k in wa if wa[k].is_floating_point())


def _float32_flips_the_mask(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(a, b, float64 mask)`` when the float32 importances of these inputs decide another mask, else None."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(64, 512, generator=g)
    b = a + 0.1 * torch.randn(64, 512, generator=g)
    imp32 = fusion_importance(b, a)
    imp = fusion_importance(b.double(), a.double())
    q = torch.quantile(imp.reshape(-1), torch.tensor([0.25, 0.5, 0.75], dtype=D), interpolation="lower")
    mask64 = imp >= q[1] + 1.5 * (q[2] - q[0])
    q32 = torch.quantile(imp32.reshape(-1), torch.tensor([0.25, 0.5, 0.75]), interpolation="lower")
    return None if torch.equal(imp32 >= q32[1] + 1.5 * (q32[2] - q32[0]), mask64) else (a, b, mask64)


def test_arcee_fusion_decides_its_mask_in_float64():
    # float32 inputs whose importances, taken in float32, put an entry on the other side of the threshold than the
    # float64 ones. The kept entries are the float64 decision's: a GPU's float32 softmax differs from a CPU's in the
    # last bits, so a float32 decision can differ between devices (the GPU check saw 0.8 % off). Which seeds give
    # such inputs depends on the CPU's float32 kernels (seed 20 did on one machine, not on another): the first of
    # 200 that does is used
    case = next((c for seed in range(200) if (c := _float32_flips_the_mask(seed)) is not None), None)
    assert case is not None, "no seed of 200 gives float32 and float64 masks that differ"
    a, b, mask64 = case
    out = arcee_fusion(a, b)
    assert torch.equal(out != a, mask64 & (a != b))
