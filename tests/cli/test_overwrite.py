"""``--overwrite`` replaces only what symfuse wrote: never an input, a folder holding one, or a foreign folder."""

from __future__ import annotations

import json

from tests.cli.helpers import listing, run_cli, toy_dataset
from tests.tiny import save_tiny, save_tiny_text_classifier


def _tree(folder):
    return {p.relative_to(folder): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


def test_overwrite_refuses_inputs_and_foreign_folders_and_replaces_its_own_output(tmp_path):
    a, b = save_tiny(tmp_path / "A", "bert", seed=0), save_tiny(tmp_path / "B", "bert", seed=1)
    data = toy_dataset(tmp_path / "D")
    refused = {
        "the merged model itself": ("merge", "--strategy", "simple", "--models", a, b, "--out", a),
        "a dataset folder": ("merge", "--strategy", "simple", "--models", a, b, "--out", data),
        "the folder holding the inputs": ("merge", "--strategy", "simple", "--models", a, b, "--out", tmp_path),
        "the source of a match": ("match", b, a, "--out", b),
        "a fine-tune's base": ("finetune", a, "--data", data, "--out", a, "--epochs", "1"),
        "the working folder": ("merge", "--strategy", "simple", "--models", a, b, "--out", "."),
    }
    work = tmp_path / "work"
    work.mkdir()
    before = _tree(tmp_path)
    for what, args in refused.items():
        res = run_cli(*args, "--overwrite", cwd=work)
        lines = [ln for ln in res.stderr.splitlines() if ln.strip() and not ln.startswith("INFO")]
        assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (what, res.stderr)
        assert any(why in lines[0] for why in ("holds the input", "only a folder symfuse wrote", "runs in")), lines
        assert "Traceback" not in res.stderr, what
        assert _tree(tmp_path) == before, f"{what}: something was written or deleted"
    # what symfuse wrote, it may replace
    out = tmp_path / "merged"
    assert run_cli("merge", "--strategy", "simple", "--models", a, b, "--out", out).returncode == 0
    first = listing(out)
    res = run_cli("merge", "--strategy", "simple", "--models", a, b, "--weights", "3", "1", "--out", out, "--overwrite")
    assert res.returncode == 0, res.stderr
    assert listing(out).keys() == first.keys() and listing(out) != first
    assert ".tmp-" not in res.stderr + res.stdout  # the log names the output, not the folder it is written in first


def test_evaluate_replaces_its_own_metrics_file_and_no_other_file(tmp_path):
    model = save_tiny_text_classifier(tmp_path / "C", num_labels=2)
    data = toy_dataset(tmp_path / "D")
    before = _tree(tmp_path)
    for victim in (model / "model.safetensors", model / "config.json", data / "meta.json"):
        res = run_cli("evaluate", model, "--data", data, "--out", victim)
        assert res.returncode == 2 and "is not a metrics file of symfuse evaluate" in res.stderr, res.stderr
        assert _tree(tmp_path) == before, victim
    metrics = tmp_path / "metrics.json"
    for _ in range(2):  # written, then replaced
        res = run_cli("evaluate", model, "--data", data, "--labels-from", data, "--out", metrics)
        assert res.returncode == 0, res.stderr
    assert json.loads(metrics.read_text())["split"] == "test"
