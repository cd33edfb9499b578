"""Grams stored in float32 (``collect_stats(gram_dtype=...)``, ``symfuse stats --gram-dtype``, the run config)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from symfuse.config import RunConfig
from symfuse.merge import merge_checkpoints
from symfuse.stats import StatsFile, collect, collect_stats
from tasks.stats import stats_settings
from tests.tiny import save_tiny_text_classifier


def _data(folder):
    folder.mkdir()
    words = ["happy", "angry", "glad", "furious", "calm", "upset", "joyful", "cross"]
    rows = [{"text": f"i feel so {w} about the {n}th day", "label": ["joy", "anger"][i % 2]}
            for n in range(4) for i, w in enumerate(words)]  # fmt: skip
    for split in ("train", "validation", "test"):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "meta.json").write_text(json.dumps({"task": "classification", "labels": ["anger", "joy"]}))
    return folder


@pytest.fixture(scope="module")
def collected(tmp_path_factory):
    """Two models, each with float64 and float32 Grams collected on the same data."""
    root = tmp_path_factory.mktemp("gram-dtype")
    data = _data(root / "toy")
    models = [save_tiny_text_classifier(root / f"m{i}", seed=i) for i in range(2)]
    stats: dict[str, list] = {"float64": [], "float32": []}
    for dtype, files in stats.items():
        for i, m in enumerate(models):
            out = root / f"s{i}-{dtype}"
            files.append(
                collect_stats(m, str(data), ["gram"], out, batch_size=8, progress=False, gram_dtype=dtype)["gram"]
            )
    return models, stats, data


def test_float32_grams_are_the_float64_grams_rounded_once(collected):
    _, stats, _ = collected
    for f64, f32 in zip(stats["float64"], stats["float32"], strict=True):
        a, b = StatsFile(f64), StatsFile(f32)
        assert sorted(a.keys()) == sorted(b.keys()) and len(a.keys()) > 4
        for key in a.keys():  # noqa: SIM118
            g64, g32 = a.get(key), b.get(key)
            assert g64.dtype == torch.float64 and g32.dtype == torch.float32
            assert torch.equal(g32, g64.float())  # accumulated in float64, rounded only when stored
        assert a.meta["n_tokens"] == b.meta["n_tokens"] and a.meta["same_input"] == b.meta["same_input"]
        assert f32.stat().st_size < 0.6 * f64.stat().st_size


def test_float32_grams_merge_as_close_to_float64_as_float64_grams(collected, tmp_path):
    models, stats, _ = collected

    def merged(dtype, grams, name):
        out = merge_checkpoints("regmean", models, tmp_path / name, stats=grams, dtype=dtype)
        return load_file(str(out / "model.safetensors"))

    ref = merged("float64", stats["float64"], "ref")
    f32_grams = merged("float32", stats["float32"], "f32-grams")
    f64_grams = merged("float32", stats["float64"], "f64-grams")
    q = "bert.encoder.layer.0.attention.self.query.weight"
    assert float(ref[q].abs().sum()) > 0  # a real merge
    worst = {"f32": 0.0, "f64": 0.0}
    for name, w in ref.items():
        if not w.is_floating_point() or w.dim() != 2:
            continue
        scale = float(w.double().norm()) or 1.0
        worst["f32"] = max(worst["f32"], float((f32_grams[name].double() - w.double()).norm()) / scale)
        worst["f64"] = max(worst["f64"], float((f64_grams[name].double() - w.double()).norm()) / scale)
    assert worst["f32"] < 1e-4 and worst["f64"] < 1e-4
    assert worst["f32"] <= 2 * worst["f64"] + 1e-7  # storage rounding stays below the float32 solve's own


def test_unknown_gram_dtype_is_refused_before_any_work(collected, tmp_path, monkeypatch):
    models, _, data = collected

    def boom(*args, **kwargs):
        raise AssertionError("the model was loaded before the dtype was checked")

    monkeypatch.setattr(collect, "load_hf_model", boom)
    with pytest.raises(ValueError, match="float16") as err:
        collect_stats(models[0], str(data), ["gram"], tmp_path / "s", gram_dtype="float16", progress=False)
    assert "float32" in str(err.value) and "\n" not in str(err.value)
    assert not list(tmp_path.iterdir())


def test_run_config_gram_dtype_and_content_keys():
    cfg = RunConfig.demo(quick=True)
    assert cfg.stats.gram_dtype == "float64"
    dataset = cfg.datasets[0].name
    plain = stats_settings(cfg, dataset, "gram")
    assert "gram_dtype" not in plain  # float64 Grams keep the content keys stored runs already have
    f32 = cfg.model_copy(update={"stats": cfg.stats.model_copy(update={"gram_dtype": "float32"})})
    assert stats_settings(f32, dataset, "gram") == plain | {"gram_dtype": "float32"}
    assert stats_settings(f32, dataset, "fisher") == stats_settings(cfg, dataset, "fisher")  # Fisher unaffected
    with pytest.raises(ValueError, match="gram_dtype"):
        RunConfig.model_validate(cfg.model_dump() | {"stats": {"gram_dtype": "float16"}})


def test_stats_command_stores_float32_grams(collected, tmp_path):
    from typer.testing import CliRunner

    from symfuse.cli import app
    from symfuse.cli import commands as _commands  # noqa: F401  (registers the commands)

    models, stats, data = collected
    out = tmp_path / "s"
    res = CliRunner().invoke(app, ["stats", str(models[0]), "--data", str(data), "--kind", "gram", "--batch-size",
                                   "8", "--gram-dtype", "float32", "--out", str(out)])  # fmt: skip
    assert res.exit_code == 0, res.output
    mine, ref = StatsFile(out / "gram.safetensors"), StatsFile(stats["float32"][0])
    for key in ref.keys():  # noqa: SIM118
        assert mine.get(key).dtype == torch.float32 and torch.equal(mine.get(key), ref.get(key))
