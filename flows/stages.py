"""Stage flows: ONE heavy task as its own flow run, so N workers on N machines / GPUs share one pipeline run.

``fusion_pipeline`` with ``fan_out: deployments`` starts one ``finetune-stage`` run per dataset and one
``stats-stage`` run per (model, kind) through their deployments (``deployments/prefect.yaml``) and waits for them
together (``tasks/fanout.py``). Each stage flow runs the very task the in-process path runs, so it stores the same
artifact under the same key and content key. Strings in, a store URI out. Separate processes also isolate torch's
global RNG (dropout), which threads of one process share (see ``symfuse.train.finetune``).
"""

from __future__ import annotations

import os
import socket

from prefect import flow
from prefect.logging import get_run_logger

from flows.runtime import end_orphaned_task_runs, forward_library_logs, staged
from symfuse.config import RunConfig
from tasks.finetune import finetune
from tasks.stats import collect_stats


def _where(stage: str) -> None:
    """Log the host and processes running the stage (the worker is the flow run's parent process)."""
    get_run_logger().info("%s runs on host %s, process %d (worker process %d)", stage, socket.gethostname(),
                      os.getpid(), os.getppid())  # fmt: skip


@flow(name="finetune-stage", log_prints=True)
def finetune_stage(config: RunConfig, dataset: str) -> str:
    """Fine-tune the base model on ``dataset`` (the pipeline's ``finetune`` task); return the model's URI."""
    forward_library_logs()
    _where(f"finetune-stage {dataset}")
    end_orphaned_task_runs()
    return staged(config, {finetune: "finetune"}).finetune(config, dataset)


@flow(name="stats-stage", log_prints=True)
def stats_stage(config: RunConfig, model: str, model_uri: str, kind: str) -> str:
    """Collect ``kind`` statistics of ``model_uri`` on its dataset (the ``collect_stats`` task); return the URI."""
    forward_library_logs()
    _where(f"stats-stage {model} {kind}")
    end_orphaned_task_runs()
    return staged(config, {collect_stats: "stats"}).collect_stats(config, model, model_uri, kind)
