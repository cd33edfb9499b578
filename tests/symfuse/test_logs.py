"""quiet_third_party: no transformers load report or per-load progress bars, whether called before or after the
libraries are imported; without it they are there (so the check can fail)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PROBE = textwrap.dedent(
    """
    import sys
    mode, data = sys.argv[1], sys.argv[2]
    if mode == "early":
        from symfuse.logs import quiet_third_party
        quiet_third_party()
    import transformers
    from symfuse.checkpoint import default_base_model
    from symfuse.data import load_task_dataset
    if mode == "late":
        from symfuse.logs import quiet_third_party
        quiet_third_party()
    transformers.AutoModelForSequenceClassification.from_pretrained(str(default_base_model()), num_labels=3)
    load_task_dataset(data)
    print("loaded")
    """
)
NOISE = ("LOAD REPORT", "MISSING", "were not initialized", "Loading weights", "Generating train split")


def _run(mode: str, tmp_path: Path) -> str:
    data = tmp_path / f"{mode}.jsonl"
    data.write_text("".join(json.dumps({"text": f"{mode} {i}", "label": "joy"}) + "\n" for i in range(3)))
    env = {k: v for k, v in os.environ.items() if not k.endswith(("VERBOSITY", "PROGRESS_BARS"))}
    env |= {"PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}", "HF_DATASETS_CACHE": str(tmp_path / f"cache-{mode}")}
    env |= {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    cmd = [sys.executable, "-c", PROBE, mode, str(data)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout + proc.stderr


@pytest.mark.parametrize("mode", ["early", "late"])
def test_quiet_third_party_hides_load_reports_and_bars(mode, tmp_path):
    out = _run(mode, tmp_path)
    assert "loaded" in out and not [n for n in NOISE if n in out], out[-2000:]


def test_without_it_the_load_report_and_bars_show(tmp_path):
    out = _run("loud", tmp_path)
    shown = [n for n in NOISE if n in out]  # (transformers 5 prints the report table, not "were not initialized")
    assert shown == ["LOAD REPORT", "MISSING", "Loading weights", "Generating train split"], out[-2000:]


def test_verbose_and_user_settings_win(monkeypatch):
    from symfuse.logs import QUIET_ENV, quiet_third_party

    for var in QUIET_ENV:
        monkeypatch.delenv(var, raising=False)
    assert quiet_third_party(verbose=True) == {} and not any(v in os.environ for v in QUIET_ENV)
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "info")
    added = quiet_third_party()
    assert os.environ["TRANSFORMERS_VERBOSITY"] == "info" and "TRANSFORMERS_VERBOSITY" not in added
    assert added == {k: v for k, v in QUIET_ENV.items() if k != "TRANSFORMERS_VERBOSITY"}
