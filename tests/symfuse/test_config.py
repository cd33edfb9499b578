"""RunConfig: the demo defaults, YAML round trip, strict validation, a schema the Prefect UI can render."""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from symfuse.config import RunConfig

DATASETS = ["crowdflower", "goemotions", "meld"]


@pytest.mark.parametrize("quick", [False, True])
def test_demo_defaults(quick):
    cfg = RunConfig.demo(quick=quick)
    assert cfg.base_model == "minilm"
    names = ["crowdflower", "meld"] if quick else DATASETS  # quick leaves out goemotions (28 classes: learns nothing)
    assert cfg.dataset_names == names
    assert cfg.stats.kinds == ["gram", "fisher"]
    # full: + TIES, the best all-model merge of bench/emotion_fusion.py on three seeds; quick has no room for it
    assert cfg.strategies == ["simple", "fisher", "regmean"] + ([] if quick else ["ties"])
    assert cfg.symmetries == ["rotation", "scaling", "ffn-permutation"]
    assert cfg.eval_datasets() == [*names, "goemotions_ekman"]
    assert cfg.anchor == "closest" and cfg.quick is quick
    n_train = 300 if quick else 2000
    assert all(d.max_train_examples == n_train and d.checkpoint is None for d in cfg.datasets)
    assert cfg.finetune.epochs == (3 if quick else 2)
    assert (cfg.finetune.lr, cfg.finetune.batch_size) == ((2e-4, 8) if quick else (1e-4, 16))
    assert cfg.finetune.max_length == 64
    assert cfg.finetune.head_lr_scale == (1.0 if quick else 100.0)  # the benchmark's best (full demo)
    assert cfg.evaluation.max_examples == (100 if quick else 500)


def test_demo_overrides_and_helpers(tmp_path, monkeypatch):
    cfg = RunConfig.demo(quick=True, run_id="t1", store_root="memory://x", device="cpu")
    assert (cfg.run_id, cfg.resolved_store_root(), cfg.resolved_device()) == ("t1", "memory://x", "cpu")
    assert cfg.dataset("meld").data == "meld"
    with pytest.raises(KeyError, match="nope"):
        cfg.dataset("nope")
    monkeypatch.setenv("SYMFUSE_STORE", str(tmp_path))
    assert RunConfig.demo().resolved_store_root() == str(tmp_path)


def test_yaml_round_trip(tmp_path):
    cfg = RunConfig.demo(quick=True)
    cfg.datasets[1].checkpoint = "s3://bucket/my-meld"
    path = tmp_path / "run.yaml"
    cfg.to_yaml(path)
    assert RunConfig.from_yaml(path) == cfg


def test_minimal_yaml_gets_defaults(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("run_id: mine\ndatasets:\n  - name: sst2\n    source: ../shared/datasets/sst2\n")
    cfg = RunConfig.from_yaml(path)
    assert cfg.dataset("sst2").data == "../shared/datasets/sst2"
    assert cfg.finetune.epochs == 2 and cfg.device == "auto" and cfg.merge_params == {}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"unknown_field": 1}, "Extra inputs are not permitted"),
        ({"finetune": {"epochs": 1, "learning_rate": 1e-4}}, "learning_rate"),
        ({"anchor": "nowhere"}, "anchor 'nowhere'"),
        ({"run_id": "a/b"}, "run id"),
        ({"run_id": "r" * 101}, r"run id 'r{40}\.\.\. \(101 characters\)': use 1-100 letters"),  # a file name's limit
        ({"run_id": ".."}, "starting with a letter or digit"),
        ({"datasets": []}, "at least 1"),
        ({"datasets": [{"name": "a"}, {"name": "a"}]}, "unique"),
        ({"device": "tpu"}, "device"),
        ({"stats": {"kinds": ["hessian"]}}, "kinds"),
        ({"strategies": ["simple", "simple"]}, "duplicate"),
        ({"labels": "shared"}, "labels"),
        ({"head_init": "random"}, "head_init"),
        ({"select": "best"}, "select"),
        ({"select_on": "goemotions_ekman"}, "select_on 'goemotions_ekman' is read only with select: greedy"),
        ({"select": "greedy", "select_on": "../x"}, "selection dataset"),
        ({"regmean_alpha": 1.5}, "regmean_alpha: Input should be less than or equal to 1"),
        ({"merge_params": {"regmean": {"alpha": 1.5}}}, r"merge_params\.regmean\.alpha: Input should be less than"),
        ({"merge_params": {"regmean": {"alhpa": 0.5}}}, "alhpa: not a parameter of strategy regmean — choose from"),
        ({"merge_params": {"regmean": {"linalg": "scipy"}}}, r"regmean\.linalg: no longer a parameter .* remove it"),
        (
            {"merge_params": {"dare": {"density": 0.5}}},
            r"dare is not in strategies \['simple', 'fisher', 'regmean', 'ties'\]",
        ),
        ({"regmean_alpha": 0.5, "merge_params": {"regmean": {"alpha": 0.4}}}, "both given"),
        ({"evaluation": {"out_of_domain": ["/data/mine"]}}, "evaluation dataset '/data/mine': a name, not a path"),
        # a set listed twice was evaluated and reported twice; a training set under out_of_domain was dropped from it
        # without a word (in_domain: true) or scored "out of domain" on its own data (in_domain: false)
        ({"evaluation": {"out_of_domain": ["goemotions_ekman"] * 2}}, "'goemotions_ekman' is listed twice in out_of"),
        ({"evaluation": {"out_of_domain": ["meld"]}}, "out_of_domain: meld is a training dataset — it is scored in do"),
        ({"evaluation": {"in_domain": False, "out_of_domain": ["meld"]}}, "meld's model would be scored out of domain"),
        ({"finetune": {"lr": float("inf")}}, r"finetune\.lr\s+Input should be a finite number"),
        ({"finetune": {"lr": 5.0}}, r"finetune\.lr\s+Input should be less than or equal to 1"),
        ({"head_refit": {"ridge": float("nan")}}, r"head_refit\.ridge\s+Input should be a finite number"),
        ({"finetune": {"seed": 2**64}}, r"finetune\.seed\s+Input should be less than or equal to 9223372036854775807"),
        (
            {"merge_params": {"dare": {"seed": -1}}, "strategies": ["dare"]},
            r"merge_params\.dare\.seed: Input should be greater than or equal to 0",
        ),
    ],
)
def test_invalid_configs_are_refused(change, message):
    with pytest.raises(ValidationError, match=message):
        RunConfig.demo(**change)


def test_anchor_may_name_a_dataset():
    assert RunConfig.demo(anchor="meld").anchor == "meld"


def test_yaml_must_be_a_mapping(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ValueError, match="mapping"):
        RunConfig.from_yaml(path)


def test_yaml_syntax_errors_name_the_file_line_and_column(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("run_id: x\ndatasets:\n  - name: meld\n    max_train_examples: [1, 2\nstrategies: [simple]\n")
    with pytest.raises(ValueError) as info:
        RunConfig.from_yaml(path)
    assert str(info.value) == (
        f"{path}: not valid YAML at line 5, column 11 (expected ',' or ']', but got ':') — fix the syntax there"
    )
    path.write_bytes(b"run_id: x\ndatasets: [{name: caf\xe9}]\n")
    with pytest.raises(ValueError, match=r"run\.yaml: not UTF-8 at line 2 — re-save it as UTF-8"):
        RunConfig.from_yaml(path)


def test_a_key_given_twice_is_refused_with_its_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("run_id: x\nstrategies: [simple]\ndatasets:\n  - name: meld\n    name: goemotions\n")
    with pytest.raises(ValueError) as info:
        RunConfig.from_yaml(path)
    assert str(info.value) == f"{path}: line 5: key 'name' given twice (first at line 4) — keep one"


def test_json_schema_is_a_typed_form():
    schema = RunConfig.model_json_schema()
    props = schema["properties"]
    device = re.compile(props["device"]["pattern"])  # the UI's form checks it as the run is created
    assert all(device.fullmatch(d) for d in ("auto", "cpu", "cuda", "cuda:1"))
    assert not any(device.fullmatch(d) for d in ("gpu", "cuda:", "cpu:0", "mps"))
    assert "datasets" in schema["required"]
    assert schema["additionalProperties"] is False
    dataset = schema["$defs"]["DatasetConfig"]
    assert set(dataset["properties"]) == {
        "name",
        "source",
        "task",
        "max_train_examples",
        "max_eval_examples",
        "checkpoint",
    }


def test_prefect_renders_it_as_a_flow_parameter():
    from prefect.utilities.callables import parameter_schema

    def fusion_pipeline(config: RunConfig) -> str:
        return config.run_id

    schema = parameter_schema(fusion_pipeline).model_dump()
    ref = schema["properties"]["config"]
    assert ref.get("$ref", "").endswith("RunConfig") or ref.get("allOf")
    assert "RunConfig" in schema["definitions"] and "DatasetConfig" in schema["definitions"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"strategies": ["simple", "regmaen"]}, r"unknown merge strategies \['regmaen'\]: choose from \['simple'"),
        ({"head_refit": {"enabled": True, "strategies": ["tise"]}}, r"unknown head_refit.strategies 'tise' — choose"),
        ({"symmetries": ["rotaton"]}, r"unknown symmetries \['rotaton'\]: choose from \['rotation'"),
    ],
)
def test_a_typo_in_a_choice_is_refused_with_the_choices(change, message):
    with pytest.raises(ValidationError, match=message):
        RunConfig.demo(**change)


@pytest.mark.parametrize("symmetries", [["ot", "ffn-permutation"], ["ot", "ot-soft"], ["ot-soft", "head-permutation"]])
def test_ot_fusion_is_one_alignment_that_replaces_the_permutations(symmetries):
    assert RunConfig.demo(symmetries=["ot-soft", "rotation", "scaling"]).symmetries[0] == "ot-soft"
    with pytest.raises(ValidationError, match=r"symmetries (ot|ot-soft) and \S+ exclude each other — take one of them"):
        RunConfig.demo(symmetries=symmetries)


def test_choices_are_the_registries_and_schema_enums():
    from symfuse.merge import MERGERS
    from symfuse.symmetry import kind_names

    props = RunConfig.model_json_schema()["properties"]
    assert set(props["strategies"]["items"]["enum"]) == set(MERGERS)
    kinds = set(kind_names("weights"))  # residual-orthogonal too: one task per model aligns the whole stream
    assert set(props["symmetries"]["items"]["enum"]) == kinds >= {"rotation", "ot", "ot-soft", "residual-orthogonal"}
    with pytest.raises(ValidationError, match="residual-permutation"):  # found from activations only
        RunConfig.demo(symmetries=["residual-permutation"])


def test_merge_params_reach_the_strategy_and_older_regmean_alpha_still_reads():
    cfg = RunConfig.demo(strategies=["regmean", "ties"], merge_params={"ties": {"density": 0.3, "lam": 2}})
    assert cfg.strategy_params("ties") == {"density": 0.3, "lam": 2} and cfg.strategy_params("regmean") == {}
    assert RunConfig.demo(regmean_alpha=0.5).strategy_params("regmean") == {"alpha": 0.5}
    # an older config's regmean_alpha is ignored when regmean is not run (as it always was)
    assert RunConfig.demo(strategies=["simple"], regmean_alpha=0.5).merge_params == {}
    again = RunConfig.model_validate(cfg.model_dump(mode="json"))
    assert again == cfg


def test_timeouts_have_defaults_and_refuse_non_positive():
    cfg = RunConfig.demo()
    assert cfg.timeouts.finetune > cfg.timeouts.merge > 0
    assert RunConfig.demo(timeouts={"merge": None}).timeouts.merge is None
    with pytest.raises(ValidationError, match="merge"):
        RunConfig.demo(timeouts={"merge": 0})
    with pytest.raises(ValidationError, match="Extra inputs"):
        RunConfig.demo(timeouts={"merging": 10})
