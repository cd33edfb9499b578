"""``fusion_pipeline``: fine-tune, collect statistics, match, merge, evaluate, report — one Prefect flow.

Read it top to bottom: each stage fans out over its inputs and hands URIs (never tensors) to the next. Every task is
idempotent by content, so re-running the flow (or retrying it) recomputes nothing already in the store. With
``config.fan_out == "deployments"`` the fine-tunes and statistics run as flow runs of the stage deployments
(``flows/stages.py``) on any worker of the pool, awaited together; everything else is unchanged.

    python -m flows [--quick] [--config run.yaml] [--store DIR] [--run-id ID]
"""

from __future__ import annotations

import os
from typing import Any

from prefect import flow, unmapped
from prefect.futures import PrefectFuture
from prefect.task_runners import ThreadPoolTaskRunner

from flows.failures import raise_failure
from flows.runtime import end_orphaned_task_runs, forward_library_logs, run_lock, staged
from flows.select import greedy_merges
from symfuse.config import RunConfig
from symfuse.logs import quiet_third_party
from symfuse.merge import MERGERS
from symfuse.preflight import RunInputError, require_runnable
from tasks.common import stop_running_tasks, warm_imports
from tasks.evaluate import evaluate
from tasks.fanout import collect_stats_remote, deployment_problems, finetune_remote
from tasks.finetune import bring_checkpoint, finetune
from tasks.housekeeping import clean_store
from tasks.inspect import inspect_models
from tasks.match import (
    assemble_matched,
    choose_anchor,
    list_modules,
    match_model,
    match_module,
    match_module_barycenter,
)
from tasks.merge import merge
from tasks.paths import loss_paths
from tasks.publish import publish_run
from tasks.report import report
from tasks.select import record_selection, validation_score
from tasks.stats import collect_stats, follow_stats

VARIANTS = ("plain", "matched")
# The timeout (``RunConfig.timeouts.<stage>``) each task runs under.
STAGES = {
    finetune: "finetune", bring_checkpoint: "other", collect_stats: "stats", follow_stats: "stats",
    list_modules: "match", choose_anchor: "match", match_module: "match", match_module_barycenter: "match",
    inspect_models: "match", match_model: "match", assemble_matched: "match", merge: "merge", evaluate: "evaluate",
    loss_paths: "evaluate",
    report: "other", publish_run: "other", clean_store: "other",
    finetune_remote: "finetune", collect_stats_remote: "stats", validation_score: "other", record_selection: "other",
}  # fmt: skip


def workers() -> int:
    """Threads of the task runner: ``$SYMFUSE_WORKERS``, else 4 (tasks are torch-bound; torch threads share cores)."""
    return int(os.environ.get("SYMFUSE_WORKERS", "4"))


def raise_first_failure(futures: list[PrefectFuture], config: RunConfig) -> None:
    """Wait for every task; raise the exception of the first failed one, in pipeline order.

    So a failed run reports its real cause, not a downstream task's "not ready".
    """
    for f in futures:
        f.wait()
    for f in futures:
        if f.state.is_failed() or f.state.is_crashed():
            raise_failure(f, config, STAGES)  # the task's exception (a time limit: naming the task and setting)


def result_of(future: PrefectFuture, upstream: list[PrefectFuture], config: RunConfig) -> Any:
    """The future's result, or the exception of the upstream task that kept it from running."""
    future.wait()
    if not future.state.is_completed():
        raise_first_failure([*upstream, future], config)
    return future.result()


@flow(name="fusion-pipeline", task_runner=ThreadPoolTaskRunner(max_workers=workers()), log_prints=True)
def fusion_pipeline(config: RunConfig) -> dict[str, Any]:
    """Fine-tune → statistics → match → merge (strategies × plain/matched, [greedy]) → evaluate → report → publish.

    Merged models and the report are staged until every task succeeded; then they become current together (the
    merged set and the report never mix two runs), and ``runs/<run>/published`` records the models they were made from.

    Args:
        config: The run (Prefect renders it as a form; YAML via ``RunConfig.from_yaml``).

    Returns:
        ``{"report": URI, "merged": {name: URI}, "evaluations": [URI, ...]}``.
    """
    forward_library_logs()  # symfuse.* INFO lines (losses, metrics, retries) into the run's logs
    require_runnable(config)  # before any task: every bad input (model, dataset, split, labels), one line each
    if problems := deployment_problems(config):  # fan_out: the server's deployments
        raise RunInputError(problems)
    with run_lock(config.run_id):  # one flow run per run_id: a second one waits, then reuses what this one stored
        end_orphaned_task_runs()  # a rescheduled run (crash): the lost attempt's task runs end Crashed
        try:
            return run_stages(config)
        except Exception:
            raise  # a failed task: the others finish, and what they store is reused by the next run
        except BaseException:  # SIGTERM, Ctrl-C, a cancellation: running tasks end at their next step
            stop_running_tasks()
            raise


def match_stage(T: Any, config: RunConfig, models: dict[str, PrefectFuture]) -> tuple:
    """Matching: ``(anchor, others, transforms, matched)`` (``anchor`` None for the barycenter).

    One task per attention / FFN module per other model onto the anchor, or (barycenter) one task per module aligning
    every model to their mean (either task returns ``{model: transform URI}``), then one ``assemble_matched`` per
    model. With ``residual-orthogonal`` (one map of the whole stream) one ``match_model`` task per other model.
    """
    names = list(models)
    if config.anchor == "barycenter":
        anchor, others = None, names
    else:
        anchor = result_of(T.choose_anchor.submit(config, models), list(models.values()), config)
        others = [n for n in names if n != anchor]
    if "residual-orthogonal" in config.symmetries:  # refused with a barycenter before the run (preflight)
        matched = {n: T.match_model.submit(config, n, models[n], models[anchor]) for n in others}
        return anchor, others, {}, matched
    modules = result_of(T.list_modules.submit(config, names[0], models[names[0]]), [models[names[0]]], config)
    if anchor is None:
        per_module = T.match_module_barycenter.map(unmapped(config), unmapped(models), modules)
        transforms = {n: per_module for n in names}
    else:
        transforms = {
            n: T.match_module.map(unmapped(config), unmapped(n), unmapped(models[n]), unmapped(models[anchor]), modules)
            for n in others
        }
    matched = {
        n: T.assemble_matched.submit(config, n, models[n], models[anchor] if anchor else None,
                                     dict(zip(modules, transforms[n], strict=True)))
        for n in others
    }  # fmt: skip
    return anchor, others, transforms, matched


def merge_stage(
    T: Any, config: RunConfig, anchor: str | None, plain: tuple[dict, dict], aligned: tuple[dict, dict], kinds: list
) -> dict[str, PrefectFuture]:
    """One merge task per strategy and variant: ``{"<strategy>-plain" | "<strategy>-matched": future}``.

    ``plain`` is ``(models, stats)`` (stats by ``(model, kind)``); ``aligned`` the matched models and their followed
    statistics, by model other than the anchor (the anchor's own stand in for it). Each merge takes only the
    statistics its strategy needs.
    """
    (models, stats), (matched, matched_stats) = plain, aligned
    names = config.dataset_names  # the merge's model order (``models`` lists fine-tuned models first)
    inputs = {
        "plain": (models, stats),
        "matched": ({n: (models[n] if n == anchor else matched[n]) for n in names},
                    {(n, k): (stats[n, k] if n == anchor else matched_stats[n, k]) for n in names for k in kinds}),
    }  # fmt: skip
    pairs = [(s, v) for s in config.strategies for v in VARIANTS]
    futures = T.merge.map(
        unmapped(config), [s for s, _ in pairs], [v for _, v in pairs],
        [inputs[v][0] for _, v in pairs],
        [{n: [inputs[v][1][n, k] for k in kinds if k in MERGERS[s].required_stats] for n in names} for s, v in pairs],
    )  # fmt: skip
    return dict(zip([f"{s}-{v}" for s, v in pairs], futures, strict=True))


def run_stages(config: RunConfig) -> dict[str, Any]:
    """The body of :func:`fusion_pipeline` (inside its flow run, holding the run lock)."""
    names = config.dataset_names
    quiet_third_party()  # also when a worker runs the flow: no load report / progress bar per checkpoint
    T = staged(config, STAGES)  # every task with its stage's timeout
    T.clean_store(config)  # versions that killed uploads of this run_id left behind
    warm_imports(config.base_model)  # transformers' lazy imports are not thread-safe: resolve them before fan-out
    unknown = [s for s in config.strategies if s not in MERGERS]
    if unknown:
        raise ValueError(f"unknown merge strategies {unknown}; choose from {sorted(MERGERS)}")

    # 1. One model per dataset: fine-tuned from the base, or the checkpoint the user brings.
    trained = [n for n in names if config.dataset(n).checkpoint is None]
    brought = [n for n in names if n not in trained]
    #    fan_out "deployments": one flow run of the finetune / stats stage deployment each, on any worker of the pool.
    remote = config.fan_out == "deployments"
    train, collect = (T.finetune_remote, T.collect_stats_remote) if remote else (T.finetune, T.collect_stats)
    models = dict(zip(trained, train.map(unmapped(config), trained), strict=True))
    models |= dict(zip(brought, T.bring_checkpoint.map(unmapped(config), brought), strict=True))

    # 2. Statistics the strategies need, one task per model × kind.
    kinds = config.stats_kinds()
    stats = {(n, k): collect.submit(config, n, models[n], k) for n in names for k in kinds}

    # 2b. Each fine-tuned model on every evaluation set, for reference: submitted now (after its statistics, which the
    #     merges wait for), so they run in the cores a fine-tune leaves idle (one fine-tune at a time), not after
    #     every merge.
    eval_sets = config.eval_datasets()
    own = [(m, d) for m in names for d in eval_sets]
    own_evals = T.evaluate.map(unmapped(config), [m for m, _ in own], [models[m] for m, _ in own], [d for _, d in own])

    # 3. Matching onto the anchor model (or, barycenter, onto the models' mean); then the matched checkpoints.
    anchor, others, transforms, matched = match_stage(T, config, models)
    #    Before any merge: will alignment help, will the merge work? (symfuse inspect; the report opens with it)
    inspection = T.inspect_models.submit(config, models, anchor or names[0]) if len(names) > 1 else None

    # 4. Statistics follow matching: Gram transformed exactly, Fisher recollected on the matched model if needed.
    matched_stats = {
        (n, k): T.follow_stats.submit(config, n, matched[n], stats[n, k], k) for n in others for k in kinds
    }

    # 5. Merge every strategy on the plain and on the matched models.
    merged = merge_stage(T, config, anchor, (models, stats), (matched, matched_stats), kinds)

    # 5b. select: greedy — per strategy, the subset of the plain models whose merge scores best on validation data
    #     (flows/select.py); its merge joins the run as "<strategy>-greedy".
    selections: list[PrefectFuture] = []
    if config.select == "greedy":
        chosen, selections = greedy_merges(T, config, models, stats, kinds)
        merged |= chosen

    # 6. Evaluate every merged model on every evaluation set (the fine-tuned models' evaluations are under way).
    grid = [(m, d) for m in merged for d in eval_sets]
    evaluations = [
        *own_evals,
        *T.evaluate.map(unmapped(config), [m for m, _ in grid], [merged[m] for m, _ in grid], [d for _, d in grid]),
    ]

    # 6b. Models not fine-tuned from one base (inspection's verdict per pair): the loss along the straight path from
    #     the anchor, plain and aligned: where alignment matters, the report shows what it bought.
    paths = (
        [T.loss_paths.submit(config, n, models[n], models[anchor], matched[n], inspection) for n in others]
        if inspection is not None and anchor is not None
        else []
    )

    # 7. Report: report.md + metrics.csv + plots in the store, markdown / table / image artifacts in Prefect.
    others_uris = [*models.values(), *stats.values(), *matched_stats.values()]
    transform_tasks = list(dict.fromkeys(f for fs in transforms.values() for f in fs))  # barycenter: shared tasks
    report_uri = T.report.submit(
        config,
        evaluations,
        list(matched.values()),
        list(merged.values()),
        others_uris,
        transform_tasks,
        selections,
        inspection,
        paths,
    )
    inspected = [inspection, *paths] if inspection else []
    every = [*models.values(), *stats.values(), *transform_tasks, *matched.values(), *inspected]
    every = [*every, *matched_stats.values(), *merged.values(), *evaluations, *selections, report_uri]
    raise_first_failure(every, config)

    # 8. Publish: the merged set and the report (staged so far) become current together, then the run's record of
    #    the models they were made from; a run that failed above published nothing (tasks/publish.py).
    published = T.publish_run.submit(config, models, merged, report_uri)
    raise_first_failure([published], config)
    return {
        "report": published.result()["report"],
        "anchor": anchor or "barycenter",
        "merged": published.result()["merged"],
        "evaluations": [f.result() for f in evaluations],
    }


if __name__ == "__main__":
    raise SystemExit("error: the demo's command is `python -m flows` (same options); flows.pipeline defines the flow")
