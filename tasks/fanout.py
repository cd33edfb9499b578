"""Heavy stages as flow runs of their own deployments (``RunConfig.fan_out == "deployments"``).

``finetune_remote`` / ``collect_stats_remote`` stand where ``finetune`` / ``collect_stats`` stand in the pipeline:
each returns the URI of what the stage flow stored, under the same key and content key as the in-process task
(computed here by the same functions), so the two paths are interchangeable and a later in-process run reuses what
the workers stored. Each one waits on ONE flow run of its stage deployment (``flows/stages.py``), created with
``run_deployment(..., as_subflow=True)``; the pipeline submits them all at once in its thread pool, so every free
worker of the pool picks one up. They hold no device slot themselves: the stage's own task does, on its worker
(``tasks/devices.py``), so N workers run N stages at once. Each stage run is named after its label
(``finetune-isear``, ``stats-isear-gram``).

A retry of one of these tasks (a transient fault while it waits, e.g. a dropped API connection) must not start a
second stage run next to the first: every stage run is created with an idempotency key made of the pipeline's flow
run, the stage and the content key, so the server hands the retry the run already started and the task waits on it
again. A new pipeline run (a new flow run id) starts new stage runs.
"""

from __future__ import annotations

from typing import Any

from symfuse.config import RunConfig
from tasks.common import logger, open_store, reuse, stored_content_key, symfuse_task
from tasks.finetune import finetune_keys
from tasks.stats import stats_keys

POLL_SECONDS = 2.0


def idempotency_key(label: str, ck: str) -> str | None:
    """The stage run's idempotency key: the current pipeline flow run, the stage label and the content key.

    None outside a flow run (a direct ``.fn()`` call): the server would otherwise hand a later call an old run.
    """
    from prefect.context import FlowRunContext, TaskRunContext

    flow_ctx, task_ctx = FlowRunContext.get(), TaskRunContext.get()
    owner = flow_ctx.flow_run.id if flow_ctx is not None and flow_ctx.flow_run is not None else None
    if owner is None and task_ctx is not None:
        owner = task_ctx.task_run.flow_run_id
    return None if owner is None else f"symfuse:{owner}:{label}:{ck}"


def deployment_problems(config: RunConfig) -> list[str]:
    """Problem lines for ``fan_out: deployments``: a server to reach, the stage deployments on it (one API call each).

    Without them every stage task failed after Prefect started, as ``internal error: ObjectNotFound: None``.

    Args:
        config: The run (nothing to check unless ``fan_out`` is ``deployments``; the stats stage only when the run
            collects statistics).
    """
    if config.fan_out != "deployments":
        return []
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound
    from prefect.settings import PREFECT_API_URL

    fix = "or set fan_out: in-process"
    if not (url := PREFECT_API_URL.value()):
        return [f"fan_out: deployments: PREFECT_API_URL is unset, so no worker would run the stage deployments — "
                f"start a server and its workers (deployments/README.md; local: deployments/local_stack.sh start, then "
                f"export PREFECT_API_URL=http://127.0.0.1:4200/api) {fix}"]  # fmt: skip
    stages = {"finetune": config.stage_deployments.finetune}
    if config.stats_kinds():
        stages["stats"] = config.stage_deployments.stats
    problems = []
    with get_client(sync_client=True) as client:
        for stage, name in stages.items():
            try:
                client.read_deployment_by_name(name)
            except ObjectNotFound:
                problems.append(f"stage_deployments.{stage}: no deployment {name} on {url} — deploy the stages "
                                f"(deployments/README.md: prefect deploy --all) {fix}")  # fmt: skip
            except Exception as exc:  # the server's answer, whatever it is, in one line
                why = " ".join(str(exc).split()) or type(exc).__name__
                return [f"fan_out: deployments: the Prefect server at {url} did not answer ({why}) — start it or fix "
                        f"PREFECT_API_URL, {fix}"]  # fmt: skip
    return problems


def run_stage(deployment: str, parameters: dict[str, Any], label: str, key: str | None) -> None:
    """Run one flow run of ``deployment`` as a subflow of the current run and wait for it.

    Args:
        deployment: ``flow-name/deployment-name``.
        parameters: The stage flow's parameters.
        label: The stage run's name (``finetune-isear``, ``stats-isear-gram``), in the UI and in log lines.
        key: Idempotency key (:func:`idempotency_key`): a retried call waits on the run the first call started.

    Raises:
        RuntimeError: if the flow run did not complete (names it, its final state and where to look).
    """
    from prefect.deployments import run_deployment

    log = logger()
    log.info("%s: starting a flow run of deployment %s on its work pool", label, deployment)
    run = run_deployment(name=deployment, parameters=parameters, timeout=None, poll_interval=POLL_SECONDS,
                         as_subflow=True, idempotency_key=key, flow_run_name=label)  # fmt: skip
    state = run.state
    if state is None or not state.is_completed():
        name = state.name if state is not None else "unknown"
        raise RuntimeError(
            f"{label}: flow run {run.name!r} ({run.id}) of deployment {deployment} ended {name}"
            f"{': ' + state.message if state is not None and state.message else ''}; see its logs, fix the cause "
            "and re-run the pipeline (what completed is reused)"
        )
    log.info("%s: flow run %s of %s completed", label, run.name, deployment)


def _stored(store, key: str, ck: str, what: str, deployment: str) -> str:
    """The URI the stage flow stored under ``key`` with content key ``ck``; one line naming the mismatch otherwise."""
    if stored_content_key(store, key) != ck:  # not reuse(): the stage made it just now, this task run is no cache hit
        raise RuntimeError(
            f"{store.uri(key)}: the {deployment} flow run completed but the store holds no {what} with content key "
            f"{ck[:16]} there; the worker runs other code or another store root (check its SYMFUSE_STORE / "
            "code version and redeploy)"
        )
    return store.uri(key)


@symfuse_task("finetune_remote", "finetune-{dataset}")
def finetune_remote(config: RunConfig, dataset: str) -> str:
    """``finetune`` run as a flow run of ``config.stage_deployments.finetune``; returns the model's URI."""
    store, (key, ck) = open_store(config), finetune_keys(config, dataset)
    what, deployment = f"fine-tuned model {dataset}", config.stage_deployments.finetune
    if (uri := reuse(store, key, ck, what)) is not None:
        return uri
    params = {"config": config.model_dump(mode="json"), "dataset": dataset}
    label = f"finetune-{dataset}"
    run_stage(deployment, params, label, idempotency_key(label, ck))
    return _stored(store, key, ck, what, deployment)


@symfuse_task("collect_stats_remote", "stats-{model}-{kind}")
def collect_stats_remote(config: RunConfig, model: str, model_uri: str, kind: str) -> str:
    """``collect_stats`` run as a flow run of ``config.stage_deployments.stats``; returns the statistics' URI."""
    store = open_store(config)
    key, ck = stats_keys(store, config, model, model_uri, kind)
    what, deployment = f"{kind} statistics of {model}", config.stage_deployments.stats
    if (uri := reuse(store, key, ck, what)) is not None:
        return uri
    params = {"config": config.model_dump(mode="json"), "model": model, "model_uri": model_uri, "kind": kind}
    label = f"stats-{model}-{kind}"
    run_stage(deployment, params, label, idempotency_key(label, ck))
    return _stored(store, key, ck, what, deployment)
