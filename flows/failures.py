"""A failed task's own error, as the flow reports it: a time limit names the task run and its setting.

A task past ``timeout_seconds`` (``RunConfig.timeouts.<stage>``, see :func:`flows.runtime.staged`) fails with
Prefect's "Scope timed out after 60 second(s).", which names neither the task nor the field to raise.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from symfuse.config import RunConfig
from symfuse.errors import SymfuseError


class StageTimedOut(SymfuseError):
    """A task ran past its stage's time limit (``RunConfig.timeouts.<stage>``) on every attempt."""


def raise_failure(future: Any, config: RunConfig, stages: Mapping[Any, str]) -> None:
    """Re-raise a failed task's exception; a time limit as one line naming the task run and its setting.

    Prefect's own message, "Scope timed out after 60 second(s).", named neither the task nor the field to raise.

    Args:
        future: The failed task's future.
        config: The run (its ``timeouts``).
        stages: Task -> stage name, as given to :func:`staged`.
    """
    from prefect.task_engine import TaskRunTimeoutError

    try:
        future.result()
    except TaskRunTimeoutError as exc:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            run = client.read_task_run(future.task_run_id)
        stage = next((s for t, s in stages.items() if t.task_key == run.task_key), None)
        if stage is None:  # not a staged task: Prefect's words, with the task run's name
            raise StageTimedOut(f"task run {run.name}: {exc}") from exc
        field = f"timeouts.{stage}"
        tries = "its attempt" if run.run_count <= 1 else f"each of its {run.run_count} attempts"
        raise StageTimedOut(
            f"task run {run.name} ran past its time limit ({field}: {getattr(config.timeouts, stage):g} s) on "
            f"{tries} — raise {field} in the run config (null: no limit), or see what held it with -v"
        ) from exc
