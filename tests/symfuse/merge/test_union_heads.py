"""Union heads: each class row merged only over the models that learned it (RegMean paper, Appendix B)."""

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from symfuse.data.labels import LABEL_SPACE_KEY, LabelSpace
from symfuse.errors import CheckpointError
from symfuse.merge import TensorInputs, merge_checkpoints, regmean_solve, weighted_mean
from symfuse.merge.heads import merge_class_rows
from symfuse.stats import collect_gram, save_stats
from tests.tiny import random_inputs, tiny_config

UNION = ["anger", "joy", "sadness", "worry"]
LEARNED = {  # joy: models 0 and 1; anger: 0 and 2; sadness: 1 only; worry: 2 only
    "m0": ["anger", "joy"],
    "m1": ["joy", "sadness"],
    "m2": ["anger", "worry"],
}


def _union_model(folder, name, seed):
    cfg = tiny_config("bert", num_labels=len(UNION), problem_type="multi_label_classification")
    cfg.id2label = dict(enumerate(UNION))
    cfg.label2id = {v: k for k, v in cfg.id2label.items()}
    space = LabelSpace(tuple(UNION), tuple(c in LEARNED[name] for c in UNION), {name: tuple(LEARNED[name])})
    setattr(cfg, LABEL_SPACE_KEY, space.to_json())
    torch.manual_seed(seed)
    model = transformers.BertForSequenceClassification(cfg).eval()
    model.save_pretrained(folder)
    return model, folder


def _gram(model, folder, name, seed):
    g = collect_gram(model, [random_inputs(model, batch=4, seq=7, seed=seed)], progress=False)
    save_stats(g.grams, folder / "gram.safetensors", {"kind": "gram", "conv1d": g.conv1d, "dataset": name})
    return folder


@pytest.fixture
def union_models(tmp_path):
    made = {n: _union_model(tmp_path / n, n, seed) for seed, n in enumerate(LEARNED)}
    stats = [_gram(m, tmp_path / f"s-{n}", n, i) for i, (n, (m, _)) in enumerate(made.items())]
    return [f for _, f in made.values()], stats


def _w(folder):
    return load_file(str(folder / "model.safetensors"))


def _row(name):
    return UNION.index(name)


def test_merge_class_rows_uses_only_the_learners_with_renormalised_weights():
    rows = [torch.full((3, 2), float(i + 1)) for i in range(3)]  # model i: every entry i + 1
    # (models, classes): class 0 learned by models 0 and 1; class 1 by models 1 and 2; class 2 by nobody
    learned = torch.tensor([[True, False, False], [True, True, False], [False, True, False]])
    t = TensorInputs("classifier.weight", rows, [0.2, 0.3, 0.5])
    out = merge_class_rows(lambda s: weighted_mean(s.tensors, s.weights), t, learned)
    torch.testing.assert_close(out[0], torch.full((2,), (0.2 * 1 + 0.3 * 2) / 0.5))
    torch.testing.assert_close(out[1], torch.full((2,), (0.3 * 2 + 0.5 * 3) / 0.8))
    assert torch.equal(out[2], rows[0][2])  # learned by none: model 0's (initial) row
    assert all(torch.equal(r, torch.full((3, 2), float(i + 1))) for i, r in enumerate(rows))  # inputs untouched


@pytest.mark.parametrize("strategy", ["simple", "regmean", "ties"])
def test_a_class_learned_by_one_model_keeps_its_row_exactly(union_models, tmp_path, strategy):
    folders, stats = union_models
    params = {"regmean": {"alpha": 0.9}, "ties": {"density": 1.0}}.get(strategy, {})
    base = None
    if strategy == "ties":  # a bare base body: the head has no base, so it is averaged per class
        base = tmp_path / "base"
        transformers.BertModel(tiny_config("bert")).save_pretrained(base)
    out = merge_checkpoints(strategy, folders, tmp_path / "out", stats=stats if strategy == "regmean" else None,
                            base=base, **params)  # fmt: skip
    got, w = _w(out), [_w(f) for f in folders]
    for name in ("classifier.weight", "classifier.bias"):
        assert torch.equal(got[name][_row("sadness")], w[1][name][_row("sadness")])
        assert torch.equal(got[name][_row("worry")], w[2][name][_row("worry")])
    report = json.loads((out / "symfuse_report.json").read_text())
    assert report["heads"]["policy"] == "union"
    assert report["heads"]["learners"] == {"anger": [0, 2], "joy": [0, 1], "sadness": [1], "worry": [2]}
    config = json.loads((out / "config.json").read_text())
    assert config[LABEL_SPACE_KEY]["learned"] == [True, True, True, True]
    assert config[LABEL_SPACE_KEY]["datasets"] == {n: v for n, v in LEARNED.items()}


def test_shared_classes_merge_over_their_learners_only(union_models, tmp_path):
    folders, stats = union_models
    simple = _w(merge_checkpoints("simple", folders, tmp_path / "simple"))
    w = [_w(f) for f in folders]
    joy, anger = _row("joy"), _row("anger")
    for name in ("classifier.weight", "classifier.bias"):
        torch.testing.assert_close(simple[name][joy], (w[0][name][joy] + w[1][name][joy]) / 2)
        torch.testing.assert_close(simple[name][anger], (w[0][name][anger] + w[2][name][anger]) / 2)
    body = "bert.encoder.layer.0.output.dense.weight"
    torch.testing.assert_close(simple[body], (w[0][body] + w[1][body] + w[2][body]) / 3)  # the body: all three
    regmean = _w(merge_checkpoints("regmean", folders, tmp_path / "regmean", stats=stats, alpha=0.9))
    grams = [load_file(str(s / "gram.safetensors"))["classifier"] for s in stats]
    want, _ = regmean_solve([w[0]["classifier.weight"][joy : joy + 1], w[1]["classifier.weight"][joy : joy + 1]],
                            grams[:2], alpha=0.9)  # fmt: skip
    torch.testing.assert_close(regmean["classifier.weight"][joy], want[0], rtol=1e-5, atol=1e-6)


def test_a_model_never_trained_on_a_class_contributes_nothing_to_it(union_models, tmp_path):
    folders, stats = union_models
    before = _w(merge_checkpoints("regmean", folders, tmp_path / "a", stats=stats, alpha=0.9))
    w2 = _w(folders[2])
    w2["classifier.weight"][_row("joy")] = 1e3  # model 2 never learned joy: its row must not matter
    w2["classifier.bias"][_row("sadness")] = -1e3
    save_file(w2, str(folders[2] / "model.safetensors"), metadata={"format": "pt"})
    after = _w(merge_checkpoints("regmean", folders, tmp_path / "b", stats=stats, alpha=0.9))
    for name in ("classifier.weight", "classifier.bias"):
        assert torch.equal(after[name][_row("joy")], before[name][_row("joy")])
        assert torch.equal(after[name][_row("sadness")], before[name][_row("sadness")])
    assert not torch.equal(after["classifier.weight"][_row("anger")], w2["classifier.weight"][_row("worry")])


def test_union_and_per_dataset_heads_do_not_mix(union_models, tmp_path):
    folders, _ = union_models
    config = json.loads((folders[1] / "config.json").read_text())
    del config[LABEL_SPACE_KEY]
    (folders[1] / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"m1: has a per-dataset head .*--labels union"):
        merge_checkpoints("simple", folders, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_bad_learned_mask_is_one_clear_error(union_models, tmp_path):
    folders, _ = union_models
    config = json.loads((folders[0] / "config.json").read_text())
    config[LABEL_SPACE_KEY]["learned"] = [True, False]
    (folders[0] / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"m0: config.json symfuse_label_space.learned must hold one"):
        merge_checkpoints("simple", folders, tmp_path / "out")
