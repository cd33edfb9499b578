"""The merge task passes parameters generically: the run values a merger asks for, then the config's merge_params."""

import pytest
from pydantic import Field

from symfuse.config import RunConfig
from symfuse.merge import MergeParams
from symfuse.merge.registry import register_merger, unregister_merger
from symfuse.merge.simple import SimpleMerger
from tasks.merge import run_context, strategy_params


class RunAwareParams(MergeParams):
    data: list[str] = Field(default_factory=list)
    seed: int = 0
    device: str = "cpu"
    scale: float = 1.0


class RunAwareMerger(SimpleMerger):
    """A merger that asks for each model's dataset, the seed and the device from the run."""

    name = "run-aware"
    run_params = ("data", "seed", "device")
    Params = RunAwareParams


@pytest.fixture
def run_aware():
    register_merger(RunAwareMerger)
    yield RunAwareMerger.name
    unregister_merger(RunAwareMerger.name)


def test_params_come_from_merge_params_and_the_run_values_a_merger_names(run_aware):
    cfg = RunConfig.demo(
        strategies=["regmean", run_aware], merge_params={"regmean": {"alpha": 0.5}, run_aware: {"scale": 2.0}},
        finetune={"seed": 7}, device="cpu",
    )  # fmt: skip
    assert strategy_params(cfg, "regmean", ["meld", "crowdflower"]) == {"alpha": 0.5}
    assert strategy_params(cfg, "simple", ["meld"]) == {}
    got = strategy_params(cfg, run_aware, ["meld", "crowdflower"])
    assert got == {"data": ["meld", "crowdflower"], "seed": 7, "device": "cpu", "scale": 2.0}
    # the user's merge_params win over a run value
    cfg = RunConfig.demo(strategies=[run_aware], merge_params={run_aware: {"seed": 3}})
    assert strategy_params(cfg, run_aware, ["goemotions"])["seed"] == 3
    assert set(run_context(cfg, ["meld"])) >= {"data", "max_examples", "batch_size", "max_length", "seed", "device"}


def test_a_run_value_that_does_not_exist_is_refused(run_aware, monkeypatch):
    monkeypatch.setattr(RunAwareMerger, "run_params", ("data", "learning_rate"))
    with pytest.raises(ValueError, match=r"run_params \['learning_rate'\] unknown — choose from \['batch_size'"):
        strategy_params(RunConfig.demo(strategies=[run_aware]), run_aware, ["meld"])
