"""CLI: `symfuse merge --models A B C ...` and `symfuse stats` on a real shared dataset."""

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file
from typer.testing import CliRunner

from symfuse.checkpoint import resolve_checkpoint
from symfuse.cli import app
from symfuse.cli import commands as _commands  # noqa: F401  (registers the commands)
from symfuse.data import shared_datasets_dir
from symfuse.stats import StatsFile
from tests.cli.helpers import run_cli
from tests.tiny import save_tiny, tiny_config

runner = CliRunner()


def test_cli_merge_takes_space_separated_models_and_stats(tmp_path):
    folders = [save_tiny(tmp_path / f"m{i}", "bert", seed=i, head="base") for i in range(3)]
    res = runner.invoke(
        app,
        [
            "merge",
            "--strategy",
            "simple",
            "--models",
            *map(str, folders),
            "--weights",
            "1",
            "1",
            "2",
            "--out",
            str(tmp_path / "out"),
        ],
    )
    assert res.exit_code == 0, res.output
    ws = [load_file(str(f / "model.safetensors")) for f in folders]
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    name = "encoder.layer.1.output.dense.weight"
    torch.testing.assert_close(got[name], (ws[0][name] + ws[1][name] + 2 * ws[2][name]) / 4)
    report = json.loads((tmp_path / "out" / "symfuse_report.json").read_text())
    assert report["params"]["weights"] == [1.0, 1.0, 2.0]
    bad = runner.invoke(
        app,
        ["merge", "--strategy", "simple", "--models", str(folders[0]), "--bogus", "1", "--out", str(tmp_path / "o2")],
    )
    assert bad.exit_code != 0


@pytest.mark.skipif(shared_datasets_dir() is None, reason="shared datasets not present")
def test_cli_stats_then_regmean_merge_on_real_text(tmp_path):
    tok = transformers.AutoTokenizer.from_pretrained(str(resolve_checkpoint("minilm")))
    folders = []
    for s in range(2):
        cfg = tiny_config("bert", vocab_size=tok.vocab_size, num_labels=6)
        torch.manual_seed(s)
        folder = tmp_path / f"m{s}"
        transformers.BertForSequenceClassification(cfg).save_pretrained(folder)
        tok.save_pretrained(folder)
        folders.append(folder)
        res = runner.invoke(
            app,
            [
                "stats",
                str(folder),
                "--data",
                "dair_emotion",
                "--kind",
                "gram,fisher",
                "--out",
                str(tmp_path / f"s{s}"),
                "--max-examples",
                "12",
                "--batch-size",
                "4",
            ],
        )
        assert res.exit_code == 0, res.output
    g = StatsFile(tmp_path / "s0" / "gram.safetensors")
    f = StatsFile(tmp_path / "s0" / "fisher.safetensors")
    assert g.meta["n_examples"] == 12 == f.meta["n_examples"] and g.meta["dataset"] == "dair_emotion"
    assert g.meta["rows"]["bert.encoder.layer.0.attention.self.query"] == g.meta["n_tokens"] > 12
    assert g.get("bert.encoder.layer.0.output.dense").shape == (48, 48)
    assert f.get("classifier.weight").shape == (6, 32) and f.meta["fisher_mode"] == "empirical"
    assert g.meta["model_fingerprint"] != StatsFile(tmp_path / "s1" / "gram.safetensors").meta["model_fingerprint"]
    res = runner.invoke(
        app,
        [
            "merge",
            "--strategy",
            "regmean",
            "--models",
            *map(str, folders),
            "--stats",
            str(tmp_path / "s0"),
            str(tmp_path / "s1"),
            "--alpha",
            "0.9",
            "--out",
            str(tmp_path / "o"),
        ],
    )
    assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "o" / "symfuse_report.json").read_text())
    assert report["counters"]["regmean_solves"] == 14 and "lstsq_fallback" not in report["counters"]


def _log_lines(shown: str) -> list[str]:
    """The lines of terminal output that name a symfuse logger, split at carriage returns too."""
    return [ln.strip() for ln in shown.replace("\r", "\n").splitlines() if "symfuse." in ln]


def test_a_merge_on_a_terminal_shows_a_progress_bar_and_a_pipe_gets_none(tmp_path):
    """stderr a terminal: a bar that reaches 100 %, log lines above it; stderr a pipe (a log, CI): no bar."""
    from tests.cli.helpers import run_on_terminal

    folders = [save_tiny(tmp_path / f"m{i}", "bert", seed=i, head="base") for i in range(2)]
    args = ("merge", "--strategy", "simple", "--models", *folders)
    code, shown = run_on_terminal(*args, "--out", tmp_path / "tty")
    assert code == 0 and "merging (simple): 100%" in shown, shown
    lines = _log_lines(shown)
    assert lines and all(ln.startswith("INFO symfuse.") for ln in lines), shown  # never glued to the bar
    piped = run_cli(*args, "--out", tmp_path / "piped")
    assert piped.returncode == 0 and "merging (simple)" not in piped.stderr, piped.stderr


def test_stats_bars_are_drawn_on_a_terminal_only(tmp_path):
    """A statistics run to a log file used to fill it with tqdm's carriage-return bars."""
    from tests.cli.helpers import run_on_terminal

    tok = transformers.AutoTokenizer.from_pretrained(str(resolve_checkpoint("minilm")))
    cfg = tiny_config("bert", vocab_size=tok.vocab_size, num_labels=6)
    transformers.BertForSequenceClassification(cfg).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    args = ("stats", tmp_path / "m", "--data", "dair_emotion", "--kind", "gram,fisher", "--max-examples", "12",
            "--batch-size", "4")  # fmt: skip
    code, shown = run_on_terminal(*args, "--out", tmp_path / "tty")
    assert code == 0 and "gram: 3batch" in shown and "fisher (empirical): 3batch" in shown, shown
    lines = _log_lines(shown)
    assert lines and all(ln.startswith("INFO symfuse.") for ln in lines), shown
    piped = run_cli(*args, "--out", tmp_path / "piped")
    assert piped.returncode == 0 and "batch/s" not in piped.stderr, piped.stderr
