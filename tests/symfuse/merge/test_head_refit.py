"""Head refit: the closed form, its limits, union masks, and a real merged folder rewritten in place."""

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

from symfuse.errors import CheckpointError
from symfuse.merge import merge_checkpoints
from symfuse.merge.head_refit import HeadFit, output_layer, refit_heads, solve_head
from tests.tiny import random_inputs, save_tiny, tiny_config


def _fit(xs, ys, masks=None):
    fit = HeadFit()
    for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
        x1 = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], 1)
        fit.grams.append(x1.T @ x1)
        fit.crosses.append(x1.T @ y)
        fit.squares.append((y * y).sum(0))
        fit.rows.append(x.shape[0])
        fit.masks.append(masks[i] if masks is not None else torch.ones(y.shape[1], dtype=torch.bool))
    return fit


def _data(seed, n=50, d=6, c=4):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    w, b = torch.randn(c, d, generator=g, dtype=torch.float64), torch.randn(c, generator=g, dtype=torch.float64)
    return g, x, w, b


@pytest.mark.parametrize("ridge", [1e-6, 0.1, 10.0])
def test_a_head_that_already_reproduces_its_logits_is_unchanged(ridge):
    _, x, w, b = _data(0)
    new_w, new_b = solve_head(w, b, _fit([x], [x @ w.T + b]), ridge)
    torch.testing.assert_close(new_w, w, rtol=0, atol=1e-10)
    torch.testing.assert_close(new_b, b, rtol=0, atol=1e-10)


def test_small_ridge_is_least_squares_and_large_ridge_keeps_the_head():
    g, x, w, b = _data(1)
    y = torch.randn(50, 4, generator=g, dtype=torch.float64)  # logits the head cannot reproduce exactly
    fit = _fit([x], [y])
    x1 = torch.cat([x, torch.ones(50, 1, dtype=x.dtype)], 1)
    want = torch.linalg.lstsq(x1, y).solution.T
    new_w, new_b = solve_head(w, b, fit, 1e-12)
    torch.testing.assert_close(torch.cat([new_w, new_b[:, None]], 1), want, rtol=0, atol=1e-8)
    far_w, far_b = solve_head(w, b, fit, 1e9)
    torch.testing.assert_close(far_w, w, rtol=0, atol=1e-6)
    torch.testing.assert_close(far_b, b, rtol=0, atol=1e-6)
    # the ridge solution by brute force: the gradient of the objective vanishes there
    mid_w, mid_b = solve_head(w, b, fit, 0.3)
    theta = torch.cat([mid_w, mid_b[:, None]], 1)
    lam = 0.3 * float((x1 * x1).sum()) / 7
    grad = (x1 @ theta.T - y).T @ x1 + lam * (theta - torch.cat([w, b[:, None]], 1))
    assert float(grad.abs().max()) < 1e-8
    assert fit.error(theta) <= fit.error(torch.cat([w, b[:, None]], 1))  # never worse than the kept head


def test_union_rows_fit_only_their_learners_and_unlearned_rows_are_kept():
    g, x0, w, b = _data(2)
    x1 = torch.randn(40, 6, generator=g, dtype=torch.float64)
    y0, y1 = torch.randn(50, 4, generator=g, dtype=torch.float64), torch.randn(40, 4, generator=g, dtype=torch.float64)
    masks = [torch.tensor([True, True, False, False]), torch.tensor([False, True, True, False])]
    new_w, new_b = solve_head(w, b, _fit([x0, x1], [y0, y1], masks), 0.1)
    alone0 = solve_head(w, b, _fit([x0], [y0]), 0.1)
    alone1 = solve_head(w, b, _fit([x1], [y1]), 0.1)
    both = solve_head(w, b, _fit([x0, x1], [y0, y1]), 0.1)
    torch.testing.assert_close(new_w[0], alone0[0][0])  # class 0: model 0 only
    torch.testing.assert_close(new_w[2], alone1[0][2])  # class 2: model 1 only (model 0's logits ignored)
    torch.testing.assert_close(new_w[1], both[0][1])  # class 1: both
    assert torch.equal(new_w[3], w[3]) and torch.equal(new_b[3], b[3])  # class 3: nobody learned it


def test_bad_ridge_and_shapes_are_refused():
    _, x, w, b = _data(3)
    fit = _fit([x], [x @ w.T + b])
    with pytest.raises(ValueError, match="ridge must be > 0"):
        solve_head(w, b, fit, 0.0)
    with pytest.raises(ValueError, match="statistics of shape"):
        solve_head(w[:, :5], b, fit, 0.1)


def _labelled(folder, labels, seed, token=False):
    cfg = tiny_config("bert", num_labels=len(labels))
    cfg.id2label = dict(enumerate(labels))
    cfg.label2id = {v: k for k, v in cfg.id2label.items()}
    torch.manual_seed(seed)
    cls = transformers.BertForTokenClassification if token else transformers.BertForSequenceClassification
    cls(cfg).save_pretrained(folder)
    return folder


def _batches(model_dir, seed, n=4):
    model = transformers.AutoModel.from_pretrained(str(model_dir))
    return [random_inputs(model, batch=8, seq=9, seed=seed + i) for i in range(n)]


def _logits(folder, batches):
    net = transformers.AutoModelForSequenceClassification.from_pretrained(str(folder)).eval()
    with torch.no_grad():
        return torch.cat([net(**b).logits for b in batches])


def test_refit_rewrites_each_kept_head_towards_its_model_and_leaves_the_body(tmp_path):
    a = _labelled(tmp_path / "emotion", ["anger", "joy", "sadness"], 0)
    b = _labelled(tmp_path / "sst2", ["negative", "positive"], 1)
    out = merge_checkpoints("simple", [a, b], tmp_path / "out")
    folders = json.loads((out / "symfuse_report.json").read_text())["heads"]["folders"]
    data = [_batches(a, 10), _batches(b, 20)]
    body_before = {k: v for k, v in load_file(str(out / "model.safetensors")).items() if not k.startswith("classif")}
    before = [_logits(out / folders[n], d) for n, d in zip(folders, data, strict=True)]
    report = refit_heads(out, folders, [a, b], data, ridge=0.01)
    after = [_logits(out / folders[n], d) for n, d in zip(folders, data, strict=True)]
    for src, d, lo0, lo1, rel in zip([a, b], data, before, after, folders.values(), strict=True):
        teacher = _logits(src, d)
        err0, err1 = float(((lo0 - teacher) ** 2).mean()), float(((lo1 - teacher) ** 2).mean())
        assert err1 < err0  # the refitted head reproduces its own model's logits better on the merged body
        head = report["heads"][rel]
        assert head["layer"] == "classifier" and head["rows"] == 32
        assert head["logit_mse_before"] == pytest.approx(err0, rel=1e-4)
        assert head["logit_mse_after"] == pytest.approx(err1, rel=1e-4)
    body_after = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(body_after[k], v) for k, v in body_before.items())  # only the head moved


def test_a_merge_of_a_model_with_itself_keeps_its_head(tmp_path):
    a = save_tiny(tmp_path / "a", "bert", seed=3, head="token")
    out = merge_checkpoints("simple", [a, a], tmp_path / "out")
    w0 = load_file(str(out / "model.safetensors"))
    model = transformers.AutoModel.from_pretrained(str(a))
    data = [[random_inputs(model, batch=4, seq=6, seed=s)] for s in (1, 2)]
    report = refit_heads(out, {"x": ".", "y": "."}, [a, a], data, ridge=1e-3)
    w1 = load_file(str(out / "model.safetensors"))
    for k in w0:
        torch.testing.assert_close(w1[k], w0[k], rtol=0, atol=1e-5)
    assert report["heads"]["."]["rows"] == 4 * 6 * 2 - 2 * 2  # tokens: padding excluded
    assert report["heads"]["."]["logit_mse_after"] < 1e-9


def test_a_model_without_a_classification_head_is_one_clear_error(tmp_path):
    a = save_tiny(tmp_path / "a", "bert", seed=3)  # bare body
    net = transformers.AutoModel.from_pretrained(str(a))
    with pytest.raises(CheckpointError, match="no classification output layer"):
        output_layer(net, set())


def test_a_merge_with_head_refit_checks_its_data_before_merging(tmp_path, monkeypatch):
    from symfuse.data.dataset import DatasetError
    from symfuse.merge import checkpoints

    a = _labelled(tmp_path / "emotion", ["anger", "joy", "sadness"], 0)
    b = _labelled(tmp_path / "sst2", ["negative", "positive"], 1)
    merged = []
    monkeypatch.setattr(checkpoints, "write_checkpoint", lambda *a, **k: merged.append(1))
    with pytest.raises(ValueError, match="1 dataset"):
        merge_checkpoints("simple", [a, b], tmp_path / "o1", head_refit={"data": [str(tmp_path / "d")]})
    with pytest.raises(DatasetError, match="no-such-set"):
        merge_checkpoints(
            "simple", [a, b], tmp_path / "o2", head_refit={"data": ["meld", str(tmp_path / "no-such-set")]}
        )
    bare = save_tiny(tmp_path / "bare", "bert", seed=3)  # no head: refused before the merge too
    with pytest.raises(CheckpointError, match="no classification head with 2 outputs to refit"):
        merge_checkpoints("simple", [bare, bare], tmp_path / "o4", head_refit={"data": ["meld", "meld"]})
    with pytest.raises(ValueError, match="ridge"):
        merge_checkpoints("simple", [a, b], tmp_path / "o3", head_refit={"data": ["meld", "meld"], "ridge": 0})
    assert not merged and not any(p.name.startswith("o") for p in tmp_path.iterdir())


def test_a_refit_that_would_write_nan_is_refused_and_leaves_the_head(tmp_path, monkeypatch):
    from symfuse.errors import NonFiniteError
    from symfuse.merge import head_refit

    a = _labelled(tmp_path / "emotion", ["anger", "joy", "sadness"], 0)
    b = _labelled(tmp_path / "sst2", ["negative", "positive"], 1)
    out = merge_checkpoints("simple", [a, b], tmp_path / "out")
    before = (out / "model.safetensors").read_bytes()
    real = head_refit.accumulate

    def poisoned(*args, **kwargs):
        gram, cross, squares, n = real(*args, **kwargs)
        return gram, cross * float("nan"), squares, n

    monkeypatch.setattr(head_refit, "accumulate", poisoned)
    folders = {"emotion": ".", "sst2": "heads/sst2"}
    with pytest.raises(NonFiniteError, match="refitted head classifier is not finite"):
        refit_heads(out, folders, [a, b], [_batches(a, 10), _batches(b, 20)])
    assert (out / "model.safetensors").read_bytes() == before
