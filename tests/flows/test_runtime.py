"""flows.runtime: per-stage timeouts (a timed-out attempt is retried), deterministic event ids."""

from __future__ import annotations

import time

import pytest
from prefect import flow, task

from flows.pipeline import STAGES
from flows.runtime import forward_library_logs, staged
from flows.watch import event_id
from symfuse.store import ArtifactStore
from tasks.policy import retry_transient
from tests.flows.conftest import run_logs, task_runs, tiny_config


def test_every_task_runs_under_its_stages_timeout(tmp_path):
    config = tiny_config(tmp_path, str(tmp_path), timeouts={"finetune": 11, "match": 7, "other": None})
    T = staged(config, STAGES)
    assert T.finetune.timeout_seconds == 11 and T.match_module.timeout_seconds == 7
    assert T.assemble_matched.timeout_seconds == 7 and T.report.timeout_seconds is None
    assert T.merge.timeout_seconds == config.timeouts.merge == 3600
    assert T.finetune.name == "finetune" and T.finetune.retries == 3  # the rest of the task is unchanged
    with pytest.raises(ValueError, match="no timeout setting for stage"):
        staged(config, {next(iter(STAGES)): "gpu"})


@task(retries=1, retry_delay_seconds=0, retry_condition_fn=retry_transient, task_run_name="slow-once")
def slow_once() -> int:
    from prefect.context import TaskRunContext

    attempt = TaskRunContext.get().task_run.run_count
    for _ in range(200 if attempt == 1 else 0):  # a stuck Python loop on the first attempt only
        time.sleep(0.05)
    return attempt


@flow
def timed_flow() -> int:
    forward_library_logs()
    return slow_once.with_options(timeout_seconds=1).submit().result()


def test_a_timed_out_attempt_is_retried():
    start = time.monotonic()
    state = timed_flow(return_state=True)
    assert state.is_completed() and state.result() == 2
    assert time.monotonic() - start < 8  # the first attempt was stopped, not waited out (10 s)
    run = task_runs(state.state_details.flow_run_id, expect=["slow-once"])["slow-once"]
    assert run.run_count == 2
    lines = run_logs(state.state_details.flow_run_id, expect="exceeded timeout")
    assert any("exceeded timeout of 1" in line or "timed out" in line.lower() for line in lines), lines
    assert not any("running in a worker thread" in line for line in lines)


def test_event_id_is_a_function_of_the_checkpoint_set(tmp_path):
    store = ArtifactStore(str(tmp_path / "store"))
    uris = []
    for name in ("a", "b", "c"):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "w.bin").write_bytes(name.encode())
        uris.append(store.put_dir(f"runs/r/incoming/{name}", folder, "test"))
    assert event_id(store, "r", uris[:2]) == event_id(store, "r", uris[1::-1])  # every tick, same set: same id
    assert event_id(store, "r", uris[:2]) != event_id(store, "r", uris)  # another checkpoint arrived: new event
    assert event_id(store, "r", uris[:2]) != event_id(store, "other", uris[:2])


@task(retries=1, retry_delay_seconds=0, retry_condition_fn=retry_transient, task_run_name="stuck-{name}")
def stuck(name: str) -> None:
    for _ in range(200):  # a Python loop that never ends in time, on every attempt
        time.sleep(0.05)


def test_a_task_past_its_time_limit_is_one_line_naming_the_task_and_the_setting(tmp_path):
    """The run ended with Prefect's "Scope timed out after 1 second(s).", naming neither the task nor the field."""
    from flows.cli import one_line
    from flows.failures import StageTimedOut, raise_failure

    config = tiny_config(tmp_path, str(tmp_path), timeouts={"evaluate": 1})

    @flow
    def timed_out() -> None:
        T = staged(config, {stuck: "evaluate"})
        future = T.stuck.submit("isear")
        future.wait()
        raise_failure(future, config, T.stages)

    with pytest.raises(StageTimedOut) as err:
        timed_out()
    assert one_line(err.value) == (
        "error: task run stuck-isear ran past its time limit (timeouts.evaluate: 1 s) on each of its 2 attempts — "
        "raise timeouts.evaluate in the run config (null: no limit), or see what held it with -v"
    )
