"""merge_checkpoints on saved tiny models: identity over copies, RegMean from stats files, heads, errors."""

import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file

from symfuse.errors import MissingStats, NonFiniteError
from symfuse.merge import MERGERS, merge_checkpoints, regmean_solve
from symfuse.stats import collect_fisher, collect_gram, save_stats
from tests.tiny import random_inputs, save_tiny, tiny_config, tiny_model

PARAMS = {"ties": {"density": 1.0}, "dare": {"drop": 0.0}, "nearswap": {"t": 0.01}}
# mergekit's defaults sum the task vectors (lambda 1): normalised, K copies give the copy back
PARAMS |= {n: {"normalize": True} for n in ("breadcrumbs", "breadcrumbs-ties", "della-linear")}


def _weights(folder):
    return load_file(str(folder / "model.safetensors"))


def _save_stats(model, folder, dataset, seed=0, fisher=True):
    b = random_inputs(model, batch=4, seq=7, seed=seed)
    b["labels"] = torch.tensor([0, 1, 2, 1])
    g = collect_gram(model, [b], progress=False)
    save_stats(g.grams, folder / "gram.safetensors", {"kind": "gram", "conv1d": g.conv1d, "dataset": dataset})
    if not fisher:
        return folder
    f = collect_fisher(model, [b], progress=False)
    save_stats(f.fisher, folder / "fisher.safetensors", {"kind": "fisher", "dataset": dataset})
    return folder


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    root = tmp_path_factory.mktemp("copies")
    model = tiny_model("bert", seed=1, head="seq")
    src = save_tiny(root / "m0", "bert", seed=1, head="seq")
    folders = [src] + [shutil.copytree(src, root / f"m{i}") for i in (1, 2)]
    stats = [_save_stats(model, root / f"s{i}", f"d{i}", seed=i) for i in range(3)]  # different data per copy
    base = save_tiny(root / "base", "bert", seed=7, head="base")
    return folders, stats, base


class Stop(Exception):
    pass


@pytest.mark.parametrize("strategy", ["simple", "regmean"])
def test_a_merge_reports_its_progress_tensor_by_tensor_and_a_raising_callback_stops_it(copies, tmp_path, strategy):
    """The fraction of the elements merged after every tensor, rising to 1; a raise (a stopped run) writes nothing."""
    folders, stats, _ = copies
    seen = []
    merge_checkpoints(strategy, folders, tmp_path / "out", stats=stats, on_progress=seen.append)
    sizes = [t.numel() for t in _weights(folders[0]).values()]
    assert len(seen) == len(sizes) and seen == sorted(seen) and seen[0] > 0 and seen[-1] == pytest.approx(1.0), seen

    def stop(fraction):
        if fraction > 0.5:
            raise Stop

    with pytest.raises(Stop):
        merge_checkpoints(strategy, folders, tmp_path / "stopped", stats=stats, on_progress=stop)
    assert not (tmp_path / "stopped").exists() and [p.name for p in tmp_path.iterdir()] == ["out"]


# regmean++ reads the models' data (tiny models without a tokenizer here): its copies test is in stats/test_sequential
@pytest.mark.parametrize("strategy", sorted(n for n, m in MERGERS.items() if not m.needs_data))
def test_every_merger_over_copies_returns_the_model(copies, tmp_path, strategy):
    folders, stats, base = copies
    k = min(3, MERGERS[strategy].model_count[1] or 3)  # slerp, nearswap ...: two; passthrough: one
    folders, stats = folders[:k], stats[:k]
    out = merge_checkpoints(strategy, folders, tmp_path / "out", stats=stats, base=base, **PARAMS.get(strategy, {}))
    got, want = _weights(out), _weights(folders[0])
    assert set(got) == set(want)
    for name, t in want.items():
        torch.testing.assert_close(got[name], t, rtol=1e-5, atol=1e-6, msg=name)
    report = json.loads((out / "symfuse_report.json").read_text())
    assert report["strategy"] == strategy and report["seconds"] >= 0 and len(report["models"]) == k
    merged = transformers.AutoModelForSequenceClassification.from_pretrained(str(out))
    assert merged.config.num_labels == 3


def test_regmean_checkpoint_matches_closed_form_and_averages_the_rest(tmp_path):
    models, stats = [], []
    for s in range(2):
        m = tiny_model("gpt2", seed=s, head="base")
        models.append(save_tiny(tmp_path / f"m{s}", "gpt2", seed=s, head="base"))
        stats.append(_save_stats(m, tmp_path / f"s{s}", f"d{s}", seed=s, fisher=False))
    out = merge_checkpoints("regmean", models, tmp_path / "out", stats=stats, alpha=0.9)
    got = _weights(out)
    ws = [_weights(m) for m in models]
    grams = [load_file(str(s / "gram.safetensors")) for s in stats]
    name = "h.1.mlp.c_proj"  # Conv1D (in=48, out=32): RegMean in the (in, out) layout
    lin = [w[name + ".weight"].double().T for w in ws]  # nn.Linear layout (out, in)
    expected, _ = regmean_solve(lin, [g[name] for g in grams], alpha=0.9)
    torch.testing.assert_close(got[name + ".weight"].double(), expected.T, rtol=1e-5, atol=1e-6)
    for plain in ("h.1.mlp.c_proj.bias", "wte.weight", "h.0.ln_1.weight"):
        torch.testing.assert_close(got[plain], (ws[0][plain] + ws[1][plain]) / 2)


def test_an_output_in_a_reused_buffer_is_written_before_the_buffer_is_reused(copies, tmp_path, monkeypatch):
    """A merger returning the merge pool's memory (overwritten by the next tensor) still gives the right files."""
    from symfuse.merge.regmean import RegMeanMerger

    folders, stats, _ = copies
    want = merge_checkpoints("regmean", folders, tmp_path / "want", stats=stats, dtype="float32")
    plain = RegMeanMerger.merge_tensor

    def reused(self, t):
        out = plain(self, t)
        return self.pool.take("the-same-slot", out.shape, out.dtype).copy_(out)

    monkeypatch.setattr(RegMeanMerger, "merge_tensor", reused)
    got = merge_checkpoints("regmean", folders, tmp_path / "got", stats=stats, dtype="float32")
    assert (got / "model.safetensors").read_bytes() == (want / "model.safetensors").read_bytes()


def _labelled(folder, labels, seed):
    cfg = tiny_config("bert", num_labels=len(labels))
    cfg.id2label = dict(enumerate(labels))
    cfg.label2id = {v: k for k, v in cfg.id2label.items()}
    torch.manual_seed(seed)
    transformers.BertForSequenceClassification(cfg).save_pretrained(folder)
    return folder


def test_different_label_sets_keep_one_head_per_dataset(tmp_path):
    a = _labelled(tmp_path / "emotion", ["anger", "joy", "sadness"], 0)
    b = _labelled(tmp_path / "sst2", ["negative", "positive"], 1)
    out = merge_checkpoints("simple", [a, b], tmp_path / "out")
    report = json.loads((out / "symfuse_report.json").read_text())
    assert report["heads"] == {"policy": "per-dataset", "folders": {"emotion": ".", "sst2": "heads/sst2"}}
    wa, wb = _weights(a), _weights(b)
    m0, m1 = _weights(out), _weights(out / "heads" / "sst2")
    for name in wa:
        if name.startswith("classifier"):
            assert torch.equal(m0[name], wa[name]) and torch.equal(m1[name], wb[name])
        else:
            torch.testing.assert_close(m0[name], (wa[name] + wb[name]) / 2)
            assert torch.equal(m0[name], m1[name])
    head_b = transformers.AutoModelForSequenceClassification.from_pretrained(str(out / "heads" / "sst2"))
    assert head_b.config.id2label == {0: "negative", 1: "positive"}


def test_given_model_names_name_the_head_folders(tmp_path):
    """The pipeline names each model after its dataset; a model's own record (here its folder) named it otherwise."""
    a = _labelled(tmp_path / "emotion", ["anger", "joy", "sadness"], 0)
    b = _labelled(tmp_path / "sst2", ["negative", "positive"], 1)
    out = merge_checkpoints("simple", [a, b], tmp_path / "out", model_names=["feelings", "reviews"])
    report = json.loads((out / "symfuse_report.json").read_text())
    assert report["heads"]["folders"] == {"feelings": ".", "reviews": "heads/reviews"}
    assert torch.equal(_weights(out / "heads" / "reviews")["classifier.weight"], _weights(b)["classifier.weight"])


def test_out_dtype_writes_the_merge_in_it_heads_and_config_included(tmp_path, caplog):
    """fp32 inputs, out_dtype bfloat16: each tensor is the float32 merge rounded once; the folder loads as bf16."""
    a = _labelled(tmp_path / "emotion", ["anger", "joy", "sadness"], 0)
    b = _labelled(tmp_path / "sst2", ["negative", "positive"], 1)
    want = merge_checkpoints("simple", [a, b], tmp_path / "fp32")
    with caplog.at_level("WARNING", logger="symfuse.merge.checkpoints"):
        got = merge_checkpoints("simple", [a, b], tmp_path / "bf16", out_dtype="bfloat16")
    for folder in (".", "heads/sst2"):
        g, w = _weights(got / folder), _weights(want / folder)
        assert g.keys() == w.keys() and all(g[k].dtype == torch.bfloat16 for k in g)
        assert all(torch.equal(g[k], w[k].to(torch.bfloat16)) for k in w)
        assert json.loads((got / folder / "config.json").read_text())["dtype"] == "bfloat16"
        model = transformers.AutoModelForSequenceClassification.from_pretrained(got / folder)
        assert next(model.parameters()).dtype == torch.bfloat16
    assert json.loads((got / "symfuse_report.json").read_text())["dtype"] == "bfloat16"
    assert "dtype" not in json.loads((want / "symfuse_report.json").read_text())
    for name, dtype in (("bf", torch.bfloat16), ("fp", torch.float16)):  # mixed inputs, named output: no warning
        tiny_model("bert", seed=3).to(dtype).save_pretrained(tmp_path / name)
    out = merge_checkpoints("simple", [tmp_path / "bf", tmp_path / "fp"], tmp_path / "f32", out_dtype=torch.float32)
    assert {t.dtype for t in _weights(out).values()} == {torch.float32}
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    with pytest.raises(ValueError, match=r"out_dtype: 'int8' is not a floating dtype to write — give one of float32"):
        merge_checkpoints("simple", [a, b], tmp_path / "int8", out_dtype="int8")
    assert not (tmp_path / "int8").exists()


def test_missing_stats_and_base_are_clear_errors(copies, tmp_path):
    folders, stats, _ = copies
    with pytest.raises(MissingStats, match="--stats"):
        merge_checkpoints("regmean", folders, tmp_path / "o1")
    with pytest.raises(MissingStats, match="base"):
        merge_checkpoints("ties", folders, tmp_path / "o2")
    with pytest.raises(MissingStats, match="one stats folder"):
        merge_checkpoints("fisher", folders, tmp_path / "o3", stats=stats[:2])
    with pytest.raises(ValueError, match="unknown merge strategy"):
        merge_checkpoints("average", folders, tmp_path / "o4")
    assert not any(p.name.startswith(("o1", "o2", "o3", "o4")) for p in tmp_path.iterdir())


def test_models_of_different_dtypes_are_merged_in_the_first_s_and_said_so(tmp_path, caplog):
    for name, dtype, seed in (("bf", torch.bfloat16, 1), ("fp", torch.float16, 2)):
        tiny_model("bert", seed=seed).to(dtype).save_pretrained(tmp_path / name)
    with caplog.at_level("WARNING", logger="symfuse.merge.checkpoints"):
        out = merge_checkpoints("simple", [tmp_path / "bf", tmp_path / "fp"], tmp_path / "out")
    assert {t.dtype for t in load_file(str(out / "model.safetensors")).values()} == {torch.bfloat16}
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert f"({tmp_path / 'bf'}: bfloat16, {tmp_path / 'fp'}: float16)" in warning, warning
    assert "written in the first model's, bfloat16 — list first the model whose dtype" in warning
    caplog.clear()
    with caplog.at_level("WARNING", logger="symfuse.merge.checkpoints"):
        merge_checkpoints("simple", [tmp_path / "bf", tmp_path / "bf"], tmp_path / "same")
    assert not [r for r in caplog.records if r.levelname == "WARNING"]  # one dtype: nothing to say


def test_a_merge_past_the_range_of_its_output_dtype_is_refused(tmp_path):
    """float32 inputs merged into float16 (--out-dtype / mergekit's dtype:) wrote inf for a value past 65504, exit 0."""
    from safetensors.torch import save_file

    a = _labelled(tmp_path / "a", ["anger", "joy"], 0)
    b = _labelled(tmp_path / "b", ["anger", "joy"], 1)
    weights = load_file(str(b / "model.safetensors"))
    name = next(n for n in weights if n.endswith("query.weight"))
    weights[name][0, 0] = 1e6
    save_file(weights, str(b / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(NonFiniteError, match=rf"merged tensor '{name}' came out NaN / inf .*float16 holds"):
        merge_checkpoints("simple", [a, b], tmp_path / "out", out_dtype="float16")
    assert not (tmp_path / "out").exists()
    out = merge_checkpoints("simple", [a, b], tmp_path / "bf16", out_dtype="bfloat16")  # in range there
    assert torch.isfinite(_weights(out)[name]).all()
