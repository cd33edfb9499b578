"""The README's main job on a fresh clone: the quick demo runs on the bundled data with no ../shared next to the
repository and no $SYMFUSE_DATASETS, and its console shows the pipeline and the metrics table, not a load report
per checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import psutil

from symfuse.config import DEMO_OUT_OF_DOMAIN, DEMO_QUICK_DATASETS

ROOT = Path(__file__).resolve().parents[1]
NOISE = (
    "LOAD REPORT",
    "MISSING",
    "were not initialized",
    "Loading weights",
    "Writing model shards",
    "Generating train split",
)


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SYMFUSE_", "PREFECT_"))}
    return env | {
        "SYMFUSE_SHARED_DATASETS": "",  # a clone with no ../shared next to it
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "SYMFUSE_CACHE": str(tmp_path / "cache"),
    }


def test_quick_demo_runs_on_bundled_data_without_shared(tmp_path):
    env = _env(tmp_path)
    store = tmp_path / "store"
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "flows", "--quick", "--store", str(store)],
        cwd=tmp_path,  # nor a shared/ folder next to the working directory
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
        check=False,
    )
    seconds = time.perf_counter() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    table = out.split("accuracy per strategy x matching", 1)[1]
    header = table.splitlines()[2].split()
    assert header == [*DEMO_QUICK_DATASETS, *DEMO_OUT_OF_DOMAIN, "in-domain", "mean", "out-of-domain", "mean"], header
    for row in ("individual crowdflower", "fisher     plain", "regmean    plain", "simple     plain", "matched"):
        assert row in table, row
    assert "pipeline wall time" in out
    assert not [n for n in NOISE if n in out], [n for n in NOISE if n in out]
    from symfuse.store import ArtifactStore, layout

    report = ArtifactStore(str(store)).local_cache(layout.report_key("demo-quick"))  # the published version
    long = pd.read_csv(report / "metrics.csv")
    assert f"(report: {report / 'report.md'})" in out  # the printed link names a file that exists
    assert (report / "report.md").is_file()
    assert set(long["dataset"]) == {*DEMO_QUICK_DATASETS, *DEMO_OUT_OF_DOMAIN}
    print(f"quick demo on bundled data: {seconds:.0f} s", table, sep="\n")  # shown with -s (CI logs)
    # the same command again: every stage is reused, the flow ends within seconds of its last task-run events, and
    # the ephemeral server must record them before it stops (else it logs "Error flushing" tracebacks)
    again = subprocess.run([sys.executable, "-m", "flows", "--quick", "--store", str(store)], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    out = again.stdout + again.stderr
    assert again.returncode == 0, out[-4000:]
    assert "accuracy per strategy x matching" in out
    assert "Traceback" not in out and "Error flushing" not in out, out[-4000:]


def test_sigterm_stops_the_demo_within_seconds_even_mid_fine_tune(tmp_path):
    """Prefect waits for a stopped flow's running tasks; the fine-tunes end at their next step (they ran on)."""
    log = (tmp_path / "stderr").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "flows", "--quick", "--store", str(tmp_path / "store")],
                            cwd=tmp_path, env=_env(tmp_path), stdout=subprocess.DEVNULL, stderr=log)  # fmt: skip
    deadline = time.monotonic() + 600
    while "finetune - epoch" not in (tmp_path / "stderr").read_text() and proc.poll() is None:
        assert time.monotonic() < deadline, "no fine-tune step logged"
        time.sleep(0.5)
    children = psutil.Process(proc.pid).children(recursive=True)  # the ephemeral Prefect server
    assert children
    start = time.perf_counter()
    proc.terminate()
    code = proc.wait(timeout=120)
    seconds = time.perf_counter() - start
    text = (tmp_path / "stderr").read_text()
    assert code == 143 and "its run was stopped" in text, text[-3000:]
    assert seconds < 20, f"{seconds:.1f} s from SIGTERM to exit"  # 38 s before (the quick fine-tunes' length)
    _, alive = psutil.wait_procs(children, timeout=15)
    for p in alive:
        p.kill()
    assert not alive, f"left running after SIGTERM: {[p.cmdline()[:4] for p in alive]}"
