"""``tasks/fanout.py`` bodies (``.fn()``): a stage deployment's flow run stands in for the in-process task.

``run_deployment`` is replaced by a stand-in that runs the stage flow's task in this process (the real server and
workers are in tests/integration/test_fanout.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import prefect.deployments
import pytest
from prefect.states import Completed, Failed

from symfuse.config import RunConfig
from symfuse.store import ArtifactStore, layout
from tasks.fanout import collect_stats_remote, finetune_remote
from tasks.finetune import finetune
from tasks.stats import collect_stats
from tests.tasks.test_tasks import base, config  # noqa: F401  (the tiny base fixture)


def _fake_deployments(monkeypatch, state=Completed, work=True) -> list[tuple[str, dict]]:
    """Replace ``run_deployment``: record the call, run the stage's task in-process (if ``work``), return a run."""
    calls = []

    def run_deployment(name, parameters, timeout, poll_interval, as_subflow, idempotency_key, flow_run_name):
        calls.append((name, parameters, idempotency_key, flow_run_name))
        assert as_subflow and timeout is None
        cfg = RunConfig.model_validate(parameters["config"])
        if work and name == cfg.stage_deployments.finetune:
            finetune.fn(cfg, parameters["dataset"])
        elif work:
            collect_stats.fn(cfg, parameters["model"], parameters["model_uri"], parameters["kind"])
        return SimpleNamespace(name="fake-run", id="0000", state=state(message="stage says no"))

    monkeypatch.setattr(prefect.deployments, "run_deployment", run_deployment)
    return calls


def test_remote_stages_store_what_the_in_process_tasks_would(base, tmp_path, monkeypatch):  # noqa: F811
    cfg = config(base, str(tmp_path / "store"), fan_out="deployments")
    calls = _fake_deployments(monkeypatch)
    model = finetune_remote.fn(cfg, "isear")
    stats = collect_stats_remote.fn(cfg, "isear", model, "gram")
    store = ArtifactStore(cfg.resolved_store_root())
    assert model == store.uri(layout.model_key("u", "isear"))
    assert stats == store.uri(layout.stats_key("u", "isear", "isear", "gram"))
    assert [name for name, *_ in calls] == ["finetune-stage/finetune-stage", "stats-stage/stats-stage"]
    assert [run_name for *_, run_name in calls] == ["finetune-isear", "stats-isear-gram"]  # the runs' names in the UI
    assert calls[0][1]["dataset"] == "isear" and calls[1][1]["model_uri"] == model
    assert calls[0][2] is None  # outside a flow run: no idempotency key (a later call must not get an old run)
    # the in-process tasks find the very same content (same content keys): nothing is recomputed, no stage re-run
    assert finetune.fn(cfg.model_copy(update={"fan_out": "in-process"}), "isear") == model
    assert finetune_remote.fn(cfg, "isear") == model and len(calls) == 2
    versions = store.manifest(layout.model_key("u", "isear"))
    assert finetune.fn(cfg, "isear") == model and store.manifest(layout.model_key("u", "isear")) == versions


def test_a_stage_run_that_stored_nothing_fails_in_one_line(base, tmp_path, monkeypatch):  # noqa: F811
    cfg = config(base, str(tmp_path / "store"), fan_out="deployments")
    _fake_deployments(monkeypatch, work=False)
    with pytest.raises(RuntimeError) as err:
        finetune_remote.fn(cfg, "isear")
    msg = str(err.value)
    assert "\n" not in msg and "models/isear" in msg and "holds no fine-tuned model isear" in msg
    assert "SYMFUSE_STORE" in msg


def test_a_failed_stage_run_fails_the_task_naming_the_run(base, tmp_path, monkeypatch):  # noqa: F811
    cfg = config(base, str(tmp_path / "store"), fan_out="deployments")
    _fake_deployments(monkeypatch, state=Failed, work=False)
    with pytest.raises(RuntimeError, match=r"finetune-isear: flow run 'fake-run' .* ended Failed: stage says no"):
        finetune_remote.fn(cfg, "isear")
    assert not ArtifactStore(cfg.resolved_store_root()).exists(layout.model_key("u", "isear"))


def test_a_retried_stage_task_waits_on_the_stage_run_it_started(base, tmp_path, monkeypatch):  # noqa: F811
    """Inside a pipeline flow run, the retry of a task asks for the stage run with the first attempt's key."""
    from prefect import flow

    keys: list[str | None] = []

    def run_deployment(name, parameters, timeout, poll_interval, as_subflow, idempotency_key, flow_run_name):
        keys.append(idempotency_key)
        if len(keys) == 1:
            raise ConnectionError("API connection dropped while waiting")  # transient: the task is retried
        cfg = RunConfig.model_validate(parameters["config"])
        finetune.fn(cfg, parameters["dataset"])
        return SimpleNamespace(name="fake-run", id="0000", state=Completed())

    monkeypatch.setattr(prefect.deployments, "run_deployment", run_deployment)

    @flow
    def pipeline(root: str) -> str:
        cfg = config(base, root, fan_out="deployments")
        return finetune_remote.with_options(retry_delay_seconds=0)(cfg, "isear")

    model = pipeline(str(tmp_path / "a"))
    # the stage made the model just now: the task returns its URI (not a Cached state, as a reused one would)
    assert model == ArtifactStore(str(tmp_path / "a")).uri(layout.model_key("u", "isear")), model
    assert len(keys) == 2 and keys[0] is not None and keys[0] == keys[1], keys
    assert keys[0].startswith("symfuse:") and keys[0].split(":")[2] == "finetune-isear"
    # another pipeline flow run (here over another store) starts its own stage run: its key names its flow run
    pipeline(str(tmp_path / "b"))
    assert len(keys) == 3 and keys[2].split(":")[1] != keys[0].split(":")[1]
