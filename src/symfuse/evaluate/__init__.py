"""Evaluation: task metrics, :func:`evaluate_model`, loss barriers.

:func:`loss_barrier` writes barrier.json/png; :func:`interpolation_losses` is the reusable core.
"""

from symfuse.evaluate.barrier import (
    barrier_from_losses,
    default_lambdas,
    interpolate_state,
    interpolation_losses,
    loss_barrier,
    plot_barrier,
)
from symfuse.evaluate.evaluate import evaluate_model
from symfuse.evaluate.metrics import accuracy, entity_f1, macro_f1, matthews, pearson_spearman, primary_metric
from symfuse.evaluate.predict import head_problem_type, load_task_model, run_model, task_loss
from symfuse.evaluate.scoring import score_logits
from symfuse.evaluate.table import metrics_table

__all__ = [
    "accuracy",
    "barrier_from_losses",
    "default_lambdas",
    "entity_f1",
    "evaluate_model",
    "head_problem_type",
    "interpolate_state",
    "interpolation_losses",
    "load_task_model",
    "loss_barrier",
    "macro_f1",
    "matthews",
    "metrics_table",
    "pearson_spearman",
    "plot_barrier",
    "primary_metric",
    "run_model",
    "score_logits",
    "task_loss",
]
