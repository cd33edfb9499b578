"""Greedy subset selection inside the pipeline (``RunConfig.select == "greedy"``): composition only.

Per strategy, the plain fine-tuned models are scored on the validation sets (the training datasets' validation
splits, or ``select_on``'s), then :func:`symfuse.merge.select.select_greedy` adds them best first, keeping each
whose addition raises the merged model's validation score. Every subset tried is merged (``merge`` task, variant
``greedy``) and evaluated on the validation splits like any model; the chosen subset's merge becomes the model
``<strategy>-greedy`` of the run, evaluated on the test sets with the others, and the path is stored for the report.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from prefect import unmapped

from flows.failures import raise_failure
from symfuse.config import RunConfig
from symfuse.merge import MERGERS
from symfuse.merge.select import select_greedy
from tasks.merge import GREEDY


def validation_config(config: RunConfig) -> RunConfig:
    """``config`` evaluating on the validation split (greedy selection's scores)."""
    return config.model_copy(update={"evaluation": config.evaluation.model_copy(update={"split": "validation"})})


def selection_sets(config: RunConfig) -> list[str]:
    """The datasets whose validation splits score the models: ``select_on``, else every training dataset."""
    return [config.select_on] if config.select_on else list(config.dataset_names)


def greedy_merges(
    T: Any, config: RunConfig, models: Mapping[str, Any], stats: Mapping[tuple[str, str], Any], kinds: Sequence[str]
) -> tuple[dict[str, Any], list[Any]]:
    """Greedy selection for every strategy of ``config``.

    Args:
        T: The staged tasks (``flows.runtime.staged``).
        config: The run.
        models: Dataset -> fine-tuned model (future or URI).
        stats: ``(dataset, kind)`` -> statistics (future or URI).
        kinds: The statistics kinds collected.

    Returns:
        ``({"<strategy>-greedy": chosen merge}, [selection record futures])``.
    """
    val, sets = validation_config(config), selection_sets(config)

    def scored(name: str, uri: Any) -> tuple[Any, list[Any]]:
        evaluations = T.evaluate.map(unmapped(val), unmapped(name), unmapped(uri), sets)
        return T.validation_score.submit(config, name, evaluations), [uri, *evaluations]

    def score(pending: tuple[Any, list[Any]]) -> float:
        future, upstream = pending
        _raise_failed(upstream, config, T.stages)  # a failed merge / evaluation raises its own error (no score)
        return future.result()

    own_futures = {n: scored(f"val-{n}", models[n]) for n in models}  # every model scored at once
    own = {n: score(f) for n, f in own_futures.items()}
    chosen, records = {}, []
    for strategy in config.strategies:
        tried: dict[tuple[str, ...], Any] = {(n,): models[n] for n in models}
        needed = [k for k in kinds if k in MERGERS[strategy].required_stats]

        def merge_and_score(
            trial: Sequence[str], strategy: str = strategy, needed: list[str] = needed, tried: dict = tried
        ) -> float:
            merged = T.merge.submit(config, strategy, GREEDY, {n: models[n] for n in trial},
                                    {n: [stats[n, k] for k in needed] for n in trial})  # fmt: skip
            tried[tuple(trial)] = merged
            return score(scored(f"val-{strategy}-{'+'.join(trial)}", merged))

        selection = select_greedy(own, merge_and_score)
        chosen[f"{strategy}-{GREEDY}"] = tried[selection.chosen]
        record = {**selection.to_json(), "on": sets, "split": "validation"}
        merges = {"+".join(k): v for k, v in tried.items()}
        records.append(T.record_selection.submit(config, strategy, record, merges))
    return chosen, records


def _raise_failed(futures: Sequence[Any], config: RunConfig, stages: Mapping[Any, str]) -> None:
    """Wait for the futures (URIs pass) and raise the first failure's own exception."""
    for f in futures:
        if hasattr(f, "wait"):
            f.wait()
            if f.state.is_failed() or f.state.is_crashed():
                raise_failure(f, config, stages)
