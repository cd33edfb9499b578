"""``true`` / ``false`` where a number is meant is refused in every config (pydantic alone would read 1 / 0)."""

import pytest
from pydantic import ValidationError

from symfuse.config import RunConfig
from symfuse.merge.head_refit import RefitOptions
from symfuse.merge.registry import merger_params
from symfuse.train.finetune import FinetuneConfig


@pytest.mark.parametrize(
    ("strategy", "values", "message"),
    [
        ("ties", {"density": True}, "density: a number, not true/false"),
        ("dare", {"seed": False}, "seed: a number, not true/false"),
        ("simple", {"weights": [True, 1]}, "weights: numbers, not true/false"),
    ],
)
def test_merge_parameters_refuse_booleans(strategy, values, message):
    with pytest.raises(ValueError, match=message):
        merger_params(strategy, values)


def test_numbers_and_real_flags_still_pass():
    assert merger_params("ties", {"density": 1}).density == 1.0  # an integer is a number
    assert merger_params("simple", {"weights": [1, 2.5]}).weights == [1.0, 2.5]
    cfg = FinetuneConfig(epochs=2, amp=False, fused_optimizer=True)
    assert (cfg.epochs, cfg.amp, cfg.fused_optimizer) == (2, False, True)


def test_run_config_refuses_booleans_for_numbers_on_load_and_on_assignment():
    with pytest.raises(ValidationError, match="a number, not true/false"):
        RunConfig.demo(quick=True, merge_params={"ties": {"density": True}}, strategies=["ties"])
    cfg = RunConfig.demo(quick=True)
    with pytest.raises(ValidationError, match="a number, not true/false"):
        cfg.finetune.epochs = True
    with pytest.raises(ValidationError, match="a number, not true/false"):
        cfg.datasets[0].max_train_examples = True


def test_library_configs_refuse_booleans():
    with pytest.raises(ValidationError, match="a number, not true/false"):
        FinetuneConfig(lr=True)
    with pytest.raises(ValidationError, match="a number, not true/false"):
        RefitOptions(data=["d"], ridge=True)
