"""The pipeline checks every input before any task starts: bad inputs are one line each, found in seconds."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from flows.cli import main
from flows.pipeline import fusion_pipeline
from symfuse.preflight import RunInputError, check_run
from symfuse.store import ArtifactStore, layout
from tests.flows.conftest import Calls, tiny_config

ROOT = Path(__file__).resolve().parents[2]


def test_the_flow_reports_every_bad_input_before_any_task(tiny_base, memory_root, monkeypatch):
    calls = Calls(monkeypatch)
    datasets = [{"name": n, "max_train_examples": 8} for n in ("isear", "meldd", "dair_emotion")]
    config = tiny_config(tiny_base, memory_root, datasets=datasets, anchor="closest",
                         evaluation={"out_of_domain": ["goemotions_ekman", "nosuch_ood"]})  # fmt: skip
    start = time.perf_counter()
    state = fusion_pipeline(config, return_state=True)
    seconds = time.perf_counter() - start
    assert state.is_failed()
    with pytest.raises(RunInputError) as info:
        state.result()
    problems = info.value.problems
    assert [p.split(":")[0] for p in problems] == ["training dataset meldd", "out-of-domain set nosuch_ood"], problems
    assert "did you mean meld?" in problems[0] and all("\n" not in p for p in problems)
    # nothing ran: no fine-tune (nor any other library call), nothing stored, within seconds
    assert calls.total() == 0 and not ArtifactStore(memory_root).list(layout.run_prefix("t"))
    assert seconds < 30, seconds


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_a_device_this_machine_lacks_is_refused_before_any_task(tiny_base, memory_root, monkeypatch):
    calls = Calls(monkeypatch)
    state = fusion_pipeline(tiny_config(tiny_base, memory_root, device="cuda:3"), return_state=True)
    assert state.is_failed()
    with pytest.raises(RunInputError) as info:
        state.result()
    assert [p.split(":")[0] for p in info.value.problems] == ["device (run config)"], info.value.problems
    assert "'cuda:3' asked for" in info.value.problems[0] and "use cpu (or auto)" in info.value.problems[0]
    assert calls.total() == 0  # no fine-tune started, where the first task used to find out
    assert check_run(tiny_config(tiny_base, memory_root, device="auto")) == []


def test_a_store_root_under_a_file_and_strategies_that_cannot_merge_the_run_are_refused(tiny_base, tmp_path):
    # both used to pass the checks: a file as store root failed every fine-tune's upload after its work (three
    # tries each); slerp on three datasets, or one dataset, failed at the merge with the CLI's "--models" line
    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    for root, what in [(afile, "is a file"), (afile / "sub" / "dir", f"is under {afile}, which is a file")]:
        problems = check_run(tiny_config(tiny_base, str(root)))
        assert len(problems) == 1 and problems[0].startswith(f"store_root {root}: {what} — give a folder"), problems
    for fine in (str(tmp_path / "new" / "store"), f"file://{tmp_path}/store", "memory://symfuse-fine"):
        assert check_run(tiny_config(tiny_base, fine)) == [], fine  # created when missing; URLs reached on use
    # a URL's scheme and a credential inside it are checked now (they failed after the fine-tunes, three tries each,
    # and the credential was in the run's logs eight times)
    for url, line in [
        ("s3://AKIATESTKEY0000:testSECRETvalue99@bucket/p", "store_root s3://[REDACTED]@bucket/p: credentials in"),
        ("foo://bucket/p", "store_root foo://bucket/p: unknown storage scheme 'foo' — give a local folder"),
    ]:
        (problem,) = check_run(tiny_config(tiny_base, url))
        assert problem.startswith(line) and "testSECRETvalue99" not in problem, problem
    root = str(tmp_path / "store")
    problems = check_run(tiny_config(tiny_base, root, strategies=["slerp", "simple", "passthrough"]))
    assert [p.split(",")[0] for p in problems] == [
        "strategies: slerp merges exactly two models",
        "strategies: passthrough merges exactly one model",
    ], problems
    assert all("this run has 3 datasets" in p and "— drop" in p for p in problems)
    one = tiny_config(tiny_base, root, datasets=[{"name": "meld", "max_train_examples": 8}], anchor="closest")
    (problem,) = check_run(one)
    assert problem.startswith("datasets: 1 dataset — a run merges one model per dataset, two or more"), problem
    pair = [{"name": n, "max_train_examples": 8} for n in ("meld", "isear")]
    assert check_run(tiny_config(tiny_base, root, datasets=pair, anchor="closest", strategies=["slerp"])) == []


def test_fan_out_to_deployments_the_server_lacks_is_refused_before_any_task(tiny_base, tmp_path, capfd, monkeypatch):
    """``fan_out: deployments`` without the stage deployments on the server (here the test harness's) passed the
    checks; every fine-tune task then failed with ``internal error: ObjectNotFound: None``, naming nothing."""
    from prefect.settings import PREFECT_API_URL

    calls = Calls(monkeypatch)
    stages = {"finetune": "finetune-stage/nowhere", "stats": "stats-stage/nowhere"}
    config = tiny_config(tiny_base, str(tmp_path / "store"), fan_out="deployments", stage_deployments=stages,
                         strategies=["simple", "regmean"])  # fmt: skip
    state = fusion_pipeline(config, return_state=True)
    with pytest.raises(RunInputError) as info:
        state.result()
    url = PREFECT_API_URL.value()
    assert info.value.problems == [
        f"stage_deployments.{stage}: no deployment {name} on {url} — deploy the stages (deployments/README.md: "
        "prefect deploy --all) or set fan_out: in-process"
        for stage, name in stages.items()
    ]
    assert calls.total() == 0 and not (tmp_path / "store").exists()
    # the command says the same before the run starts; only the deployments a run uses are needed (no statistics)
    config.model_copy(update={"strategies": ["simple"]}).to_yaml(tmp_path / "run.yaml")
    assert main(["--config", str(tmp_path / "run.yaml")]) == 1
    err = capfd.readouterr().err.strip().splitlines()
    assert err == [f"error: {info.value.problems[0]}"], err
    with pytest.raises(ValueError, match="expected <flow name>/<deployment name>"):
        tiny_config(tiny_base, str(tmp_path), stage_deployments={"finetune": "finetune-stage"})


def test_fan_out_to_deployments_without_a_server_is_refused_before_prefect_starts(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env |= {"PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]), "PREFECT_HOME": str(tmp_path / "prefect")}
    datasets = [{"name": n, "max_train_examples": 8} for n in ("meld", "isear")]
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({"datasets": datasets, "fan_out": "deployments"}))
    res = subprocess.run([sys.executable, "-m", "flows", "--config", "run.yaml", "--store", "store"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 1 and len(lines) == 1, res.stderr
    assert lines[0].startswith("error: fan_out: deployments: PREFECT_API_URL is unset, so no worker would run"), lines
    assert not (tmp_path / "store").exists() and not list((tmp_path / "prefect").glob("*.db"))


def test_python_m_flows_refuses_a_missing_dataset_in_seconds_before_prefect_starts(tmp_path):
    config = {
        "run_id": "missing",
        "base_model": "minilm",
        "datasets": [{"name": n, "max_train_examples": 300} for n in ("crowdflower", "nosuch_set", "meld")],
        "finetune": {"epochs": 1},
        "strategies": ["simple", "regmean"],
        "evaluation": {"out_of_domain": ["goemotions_ekman"]},
        "device": "cpu",
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env |= {"PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]), "PREFECT_HOME": str(tmp_path / "prefect"),
            "SYMFUSE_SHARED_DATASETS": "", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}  # fmt: skip
    start = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "flows", "--config", "run.yaml", "--store", "store"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    seconds = time.perf_counter() - start
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 1, res.stderr
    assert len(lines) == 1 and lines[0].startswith("error: training dataset nosuch_set: no dataset of that name"), lines
    assert "Traceback" not in res.stderr + res.stdout
    assert seconds < 30, seconds  # the run this replaces fine-tuned the other sets first (126.7 s)
    # nothing trained or stored, and Prefect never started (no database in PREFECT_HOME)
    assert not (tmp_path / "store").exists() and not list((tmp_path / "prefect").glob("*.db"))


def test_python_m_flows_pipeline_names_the_demo_command_and_runs_nothing(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env |= {"PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]), "PREFECT_HOME": str(tmp_path / "prefect")}
    res = subprocess.run([sys.executable, "-m", "flows.pipeline", "--quick", "--store", "store"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 1 and len(lines) == 1 and "`python -m flows`" in lines[0], res.stderr
    assert not (tmp_path / "store").exists() and not list((tmp_path / "prefect").glob("*.db"))
