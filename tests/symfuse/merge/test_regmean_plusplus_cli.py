"""`symfuse merge --strategy regmean++` end to end on tiny BERTs, and its bad inputs (one line, nothing written)."""

import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from symfuse.checkpoint import resolve_checkpoint
from symfuse.cli import app
from symfuse.cli import commands as _commands  # noqa: F401  (registers the commands)
from symfuse.errors import NonFiniteError
from symfuse.match import disguise_checkpoint
from symfuse.merge import merge_checkpoints
from symfuse.merge.regmean_plusplus_merger import RegMeanPlusPlusMerger
from tests.cli.helpers import assert_merge_refused
from tests.tiny import nan_copy, save_tiny, tiny_config

runner = CliRunner()


def _toy(folder, labels):
    """A toy classification dataset with ``labels`` (a few rows each)."""
    folder.mkdir(parents=True)
    words = ["happy", "angry", "calm", "sad", "scared"]
    rows = [{"text": f"i feel so {w} and {v} today", "label": lab} for w, lab in zip(words, labels * 2) for v in words]
    for split in ("train", "validation", "test"):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "meta.json").write_text(json.dumps({"task": "classification", "labels": sorted(labels)}))
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Two tiny 2-layer BERTs with the MiniLM tokenizer, the SAME embeddings, different label sets and data."""
    d = tmp_path_factory.mktemp("rmpp")
    tok = transformers.AutoTokenizer.from_pretrained(str(resolve_checkpoint("minilm")))
    data = [_toy(d / "joyful", ["anger", "joy"]), _toy(d / "fearful", ["fear", "joy", "sadness"])]
    folders, emb = [], None
    for s, ds in enumerate(data):
        cfg = tiny_config("bert", vocab_size=tok.vocab_size, num_labels=2 + s)
        torch.manual_seed(s)
        model = transformers.BertForSequenceClassification(cfg)
        if emb is None:
            emb = {n: t for n, t in model.state_dict().items() if "embeddings" in n}
        model.load_state_dict(emb, strict=False)  # shared embeddings: layer 0 is exactly RegMean's
        folder = d / ds.name
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
        folders.append(folder)
    return d, folders, data


def _ok(args):
    res = runner.invoke(app, list(map(str, args)))
    assert res.exit_code == 0, res.output
    return res


def test_cli_regmean_plusplus_merges_layer_0_like_regmean_and_keeps_heads(tiny):
    d, folders, data = tiny
    out = d / "pp"
    _ok(["merge", "--strategy", "regmean++", "--models", *folders, "--data", *data, "--alpha", "0.9", "--out", out])
    for i, (m, ds) in enumerate(zip(folders, data, strict=True)):
        _ok(["stats", m, "--data", ds, "--kind", "gram", "--out", d / f"s{i}"])
    _ok(["merge", "--strategy", "regmean", "--models", *folders, "--stats", d / "s0", d / "s1", "--out", d / "rm"])
    pp, rm = load_file(str(out / "model.safetensors")), load_file(str(d / "rm" / "model.safetensors"))
    layer0 = [n for n in pp if n.startswith("bert.encoder.layer.0.") and n.endswith("dense.weight")]
    assert len(layer0) == 3
    for n in layer0:  # same inputs to layer 0: RegMean's solution
        torch.testing.assert_close(pp[n], rm[n], rtol=0, atol=1e-6)
    n1 = "bert.encoder.layer.1.output.dense.weight"  # Grams of the merged layer 0's outputs: not RegMean's
    assert float((pp[n1] - rm[n1]).norm()) > 1e-5 * float(rm[n1].norm())
    report = json.loads((out / "symfuse_report.json").read_text())
    assert report["strategy"] == "regmean++" and report["heads"]["policy"] == "per-dataset"
    assert report["params"]["data"] == [str(p) for p in data] and report["counters"]["models_run"] == 2
    # the other dataset's folder: the same merged body, its own classifier
    other = load_file(str(out / report["heads"]["folders"]["fearful"] / "model.safetensors"))
    torch.testing.assert_close(other[n1], pp[n1], rtol=0, atol=0)
    own = load_file(str(folders[1] / "model.safetensors"))
    assert torch.equal(other["classifier.weight"], own["classifier.weight"])
    assert other["classifier.weight"].shape[0] == 3
    model = transformers.AutoModelForSequenceClassification.from_pretrained(str(out))  # a loadable checkpoint
    assert model.config.num_labels == 2


@pytest.mark.parametrize(
    ("args", "code", "expect"),
    [
        ("--models {A} {B}", 2, "--data: --strategy regmean++ collects its Grams"),
        ("--models {A} {B} --data {DATA}", 2, "--data: 1 dataset(s) for 2 models"),
        ("--models {A} {B} --data {DATA} {DATA} --max-examples 0", 2, "--max-examples"),
        ("--models {A} {B} --data {DATA} nosuch_dataset", 1, "nosuch_dataset"),
        ("--models {A} {B} --data {DATA} {DATA} --stats {DATA} {DATA}", 2, "--stats"),
    ],
    ids=["no-data", "data-count", "max-examples-zero", "unknown-dataset", "stats-not-read"],
)
def test_bad_inputs_fail_in_one_line(tmp_path, args, code, expect):
    assert_merge_refused(tmp_path, "regmean++", args, code, expect)


def test_data_is_refused_by_strategies_that_do_not_read_it(tmp_path):
    a, b = save_tiny(tmp_path / "a", "bert", seed=1), save_tiny(tmp_path / "b", "bert", seed=2)
    res = runner.invoke(app, ["merge", "--strategy", "simple", "--models", str(a), str(b), "--data", "x", "x",
                              "--out", str(tmp_path / "o")])  # fmt: skip
    assert res.exit_code == 2 and "--data: not a parameter of --strategy simple" in res.output
    assert "(--data also feeds --refit-heads: add it to refit the heads)" in res.output  # the other use of --data
    assert not (tmp_path / "o").exists()


def test_merge_yaml_takes_its_data_and_refuses_it_missing(tmp_path):
    a, b = save_tiny(tmp_path / "a", "bert", seed=1), save_tiny(tmp_path / "b", "bert", seed=2)
    cfg = tmp_path / "merge.yaml"
    cfg.write_text(f"strategy: regmean++\nmodels: [{a}, {b}]\nparams: {{max_examples: 8}}\n")
    res = runner.invoke(app, ["merge", "--config", str(cfg), str(tmp_path / "o")])
    assert res.exit_code == 2 and f"{cfg}: --data: --strategy regmean++ collects its Grams" in res.output
    cfg.write_text(f"strategy: regmean++\nmodels: [{a}, {b}]\nparams: {{data: [x], max_examples: 8}}\n")
    res = runner.invoke(app, ["merge", "--config", str(cfg), str(tmp_path / "o")])
    assert res.exit_code == 2 and "params.data: 1 dataset(s) for 2 models" in res.output
    assert not (tmp_path / "o").exists()


def test_checkpoint_merge_equals_the_library_and_solves_the_tail_per_row_subset(tmp_path):
    # same label set: the classifier is merged too, after the stack, from Grams the merger hands to merge_checkpoints
    from symfuse.checkpoint import load_hf_model
    from symfuse.data import load_task_dataset, make_batches
    from symfuse.merge import MERGERS, TensorInputs, merge_checkpoints
    from symfuse.merge.regmean import regmean_solve
    from symfuse.merge.sequential import regmean_plusplus_state

    tok = transformers.AutoTokenizer.from_pretrained(str(resolve_checkpoint("minilm")))
    data = [_toy(tmp_path / f"d{i}", ["anger", "joy"]) for i in range(2)]
    folders = []
    for s in range(2):
        torch.manual_seed(s)
        transformers.BertForSequenceClassification(tiny_config("bert", vocab_size=tok.vocab_size, num_labels=2)
                                                   ).save_pretrained(tmp_path / f"m{s}")  # fmt: skip
        tok.save_pretrained(tmp_path / f"m{s}")
        folders.append(tmp_path / f"m{s}")
    out = merge_checkpoints("regmean++", folders, tmp_path / "out", data=[str(d) for d in data], max_examples=8)
    got = load_file(str(out / "model.safetensors"))
    nets = [load_hf_model(f) for f in folders]
    batches = [make_batches(load_task_dataset(str(d)), f, "train", 16, 128, 8, 13) for d, f in zip(data, folders)]
    tail: dict = {}
    want = regmean_plusplus_state(nets, batches, [0.5, 0.5], 0.9, tail_grams=tail)
    assert set(tail) == {"bert.pooler.dense", "classifier"}
    for n, t in want.items():
        torch.testing.assert_close(got[n], t, rtol=1e-5, atol=1e-6, msg=n)
    report = json.loads((out / "symfuse_report.json").read_text())
    assert report["heads"]["policy"] == "merged" and report["counters"]["regmean_solves"] == 2
    # a caller merging the classifier row by row over a subset of models (union heads) gets RegMean of that subset
    merger = MERGERS["regmean++"](data=[str(d) for d in data], max_examples=8)
    merger.prepare(folders)
    ws = [net.classifier.weight.detach()[1:] for net in nets]
    sub = merger.merge_tensor(TensorInputs("classifier.weight", ws, [0.5, 0.5], gram=tail["classifier"]))
    torch.testing.assert_close(sub, regmean_solve(ws, tail["classifier"], [0.5, 0.5], 0.9)[0])
    torch.testing.assert_close(sub, got["classifier.weight"][1:], rtol=1e-5, atol=1e-6)


def test_union_heads_merge_with_regmean_plus_plus_class_by_class(tmp_path):
    # union heads: one learner keeps its row (weight and bias) exactly; a shared class's bias is the mean over its
    # learners and its weight rows RegMean over them (Grams collected on the merged body), never over all models
    from symfuse.data.labels import LABEL_SPACE_KEY, LabelSpace
    from symfuse.merge import merge_checkpoints

    union = ["anger", "joy", "sadness", "worry"]
    learned = {"m0": ["anger", "joy"], "m1": ["joy", "sadness"], "m2": ["anger", "worry"]}
    tok = transformers.AutoTokenizer.from_pretrained(str(resolve_checkpoint("minilm")))
    folders, data = [], []
    for seed, (name, classes) in enumerate(learned.items()):
        cfg = tiny_config("bert", vocab_size=tok.vocab_size, num_labels=len(union),
                          problem_type="multi_label_classification")  # fmt: skip
        cfg.id2label = dict(enumerate(union))
        cfg.label2id = {v: k for k, v in cfg.id2label.items()}
        space = LabelSpace(tuple(union), tuple(c in classes for c in union), {name: tuple(classes)})
        setattr(cfg, LABEL_SPACE_KEY, space.to_json())
        torch.manual_seed(seed)
        transformers.BertForSequenceClassification(cfg).save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
        folders.append(tmp_path / name)
        data.append(str(_toy(tmp_path / f"d-{name}", classes)))
    out = merge_checkpoints("regmean++", folders, tmp_path / "out", data=data, max_examples=8)
    got, w = load_file(str(out / "model.safetensors")), [load_file(str(f / "model.safetensors")) for f in folders]
    row = union.index
    for name in ("classifier.weight", "classifier.bias"):
        assert torch.equal(got[name][row("sadness")], w[1][name][row("sadness")])
        assert torch.equal(got[name][row("worry")], w[2][name][row("worry")])
    bias = "classifier.bias"
    torch.testing.assert_close(got[bias][row("joy")], (w[0][bias][row("joy")] + w[1][bias][row("joy")]) / 2)
    torch.testing.assert_close(got[bias][row("anger")], (w[0][bias][row("anger")] + w[2][bias][row("anger")]) / 2)
    report = json.loads((out / "symfuse_report.json").read_text())
    assert report["heads"]["policy"] == "union" and report["counters"]["regmean_solves"] >= 2


def test_a_nan_in_a_model_is_named_before_the_data_is_read(tiny, tmp_path, monkeypatch):
    """regmean++ ran both models over their data, then said the merged tensor "came out NaN / inf (inputs were
    finite)", blaming the output; a NaN in a disguised model's head was copied into the disguise with exit 0."""
    _, folders, data = tiny
    bad = nan_copy(folders[1], tmp_path / "nan")
    monkeypatch.setattr(RegMeanPlusPlusMerger, "prepare", lambda *a: pytest.fail("the models ran on the data"))
    with pytest.raises(NonFiniteError, match=rf"^{bad}/model.safetensors: tensor 'bert\.encoder\.layer\.0\.attention"):
        merge_checkpoints("regmean++", [folders[0], bad], tmp_path / "m", data=[str(p) for p in data])
    head = tmp_path / "inf-head"  # a tensor outside every transformed module
    shutil.copytree(folders[0], head)
    weights = load_file(str(head / "model.safetensors"))
    weights["classifier.weight"][0, 0] = float("inf")
    save_file(weights, str(head / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(NonFiniteError, match=rf"^{head}/model.safetensors: tensor 'classifier\.weight'"):
        disguise_checkpoint(head, tmp_path / "d", seed=1)
    assert not (tmp_path / "m").exists() and not (tmp_path / "d").exists()
