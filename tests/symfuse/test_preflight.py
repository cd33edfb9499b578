"""A run's inputs checked before any task (symfuse.preflight): each problem one line naming the artifact and fix."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from symfuse.config import RunConfig
from symfuse.data import DatasetError
from symfuse.data.locate import BUNDLED_DIR, find_named_dataset
from symfuse.data.probe import probe_dataset, split_names
from symfuse.preflight import RunInputError, check_run, require_runnable
from tests.tiny import save_tiny


@pytest.fixture(autouse=True)
def _bundled_only(monkeypatch):
    """Bare names resolve to the bundled demo data only (as on a clone without ../shared)."""
    monkeypatch.setenv("SYMFUSE_SHARED_DATASETS", "")
    monkeypatch.delenv("SYMFUSE_DATASETS", raising=False)


def dataset(folder: Path, labels=("anger", "joy"), splits=("train", "validation", "test"), task="classification"):
    """A small dataset folder: every split with a few records over ``labels``."""
    folder.mkdir(parents=True)
    rows = [{"text": f"text {i}", "label": labels[i % len(labels)]} for i in range(6)]
    if task == "ner":
        rows = [{"tokens": ["a", "b"], "tags": [labels[0], labels[-1]]} for _ in range(6)]
    for split in splits:
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    key = "tags" if task == "ner" else "labels"
    (folder / "meta.json").write_text(json.dumps({"task": task, key: list(labels)}))
    return str(folder)


NOTHING = (
    "evaluation: in_domain is false and out_of_domain is empty — nothing would be evaluated; set in_domain: "
    "true or name a set under out_of_domain"
)


def unevaluated(config: RunConfig) -> list[str]:
    """``check_run``'s problems but the first, which says the run evaluates nothing (it failed at its report)."""
    problems = check_run(config)
    assert problems[:1] == [NOTHING], problems
    return problems[1:]


def config(**overrides) -> RunConfig:
    data = {
        "run_id": "t",
        "base_model": "minilm",
        "datasets": [{"name": "crowdflower"}, {"name": "meld"}],
        "strategies": ["simple", "regmean"],
        "evaluation": {"out_of_domain": ["goemotions_ekman"]},
        "device": "cpu",
    }
    return RunConfig.model_validate(data | overrides)


def test_the_demos_have_no_problem_and_are_checked_in_well_under_a_second():
    for quick in (True, False):
        start = time.perf_counter()
        assert check_run(RunConfig.demo(quick=quick)) == []
        assert time.perf_counter() - start < 3  # a handful of records per split, never a whole dataset
    require_runnable(RunConfig.demo(quick=True))  # nothing raised


def test_every_problem_is_reported_at_once_one_line_each(tmp_path):
    base = save_tiny(tmp_path / "base", "bert")
    cfg = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps(cfg | {"model_type": "bret"}))
    bad_meta = Path(dataset(tmp_path / "badmeta"))
    (bad_meta / "meta.json").write_text('{"task": "classification", labels: []}')
    latin = Path(dataset(tmp_path / "latin"))
    (latin / "test.jsonl").write_bytes(b'{"text": "caf\xe9", "label": "joy"}\n')
    malformed = Path(dataset(tmp_path / "malformed"))
    (malformed / "train.jsonl").write_text('{"text": "ok", "label": "joy"}\n{"text": "x", "label": "love"}\n')
    no_train = dataset(tmp_path / "notrain", splits=("validation", "test"))
    datasets = [{"name": "crowdflower"}, {"name": "meldd"}, {"name": "bm", "source": str(bad_meta)},
                {"name": "latin", "source": str(latin)}, {"name": "malformed", "source": str(malformed)},
                {"name": "notrain", "source": no_train}]  # fmt: skip
    c = config(base_model=str(base), datasets=datasets, evaluation={"out_of_domain": ["goemotions_ekman", "nosuch"]})
    start = time.perf_counter()
    problems = check_run(c)
    assert time.perf_counter() - start < 5
    expected = [
        (f"base model {base}: {base}/config.json: model_type 'bret' is not an architecture", "did you mean 'bert'?"),
        ("training dataset meldd: no dataset of that name (did you mean meld?)", "Give a dataset folder"),
        (f"training dataset bm: {bad_meta}/meta.json:1:28: not valid JSON", "— fix the file"),
        (f"training dataset latin: {latin}/test.jsonl:1: not UTF-8 (byte 0xe9", "— re-save it as UTF-8"),
        (
            f"training dataset malformed: {malformed}/train.jsonl:2: bad classification record: unknown label 'love'",
            "— fix or remove that line",
        ),
        (
            f"training dataset notrain: no train split in {no_train} (it has validation, test); the fine-tune trains",
            "— add train.jsonl there, or change the run config",
        ),
        ("out-of-domain set nosuch: no dataset of that name", "Give a dataset folder"),
    ]
    assert len(problems) == len(expected), "\n".join(problems)
    for line, (start_, fix) in zip(problems, expected, strict=True):
        assert "\n" not in line and line.startswith(start_) and fix in line, line
    with pytest.raises(RunInputError) as info:
        require_runnable(c)
    assert info.value.problems == problems and str(info.value).splitlines() == problems


def test_statistics_a_strategy_reads_must_be_collected():
    """stats.kinds without gram and a RegMean merge: the run trained both models, then failed in every merge."""
    problems = check_run(config(stats={"kinds": ["fisher"]}, strategies=["simple", "regmean", "fisher"]))
    assert problems == [
        "stats.kinds: fisher lacks gram, which regmean reads — add gram to stats.kinds (or drop regmean from "
        "strategies)"
    ]


def test_a_dataset_named_like_a_merged_model_is_refused():
    """A dataset simple-plain shared eval/simple-plain/<set> with the simple merge: the merged row vanished from the
    report, exit 0."""
    ds = [{"name": "simple-plain", "source": "crowdflower"}, {"name": "meld"}]
    assert check_run(config(datasets=ds, anchor="meld")) == [
        "datasets: simple-plain is the name of a merged model of the run (strategy simple) — its evaluations would "
        "share a record with that merge's; rename the dataset"
    ]
    assert (
        check_run(config(datasets=[{"name": "plain", "source": "crowdflower"}, {"name": "meld"}], anchor="meld")) == []
    )


def test_merge_weights_that_do_not_fit_the_datasets_are_refused():
    """Found by the merge task after both fine-tunes, statistics and evaluations, in a line naming no field."""
    for w in ([1, 2, 3], [-1, 1], [0, 0]):
        assert check_run(config(strategies=["simple"], merge_params={"simple": {"weights": w}})) == [
            f"merge_params.simple.weights: {w} — give 2 non-negative numbers (one per dataset, in "
            "the order of datasets) with a positive sum"
        ]
    assert check_run(config(strategies=["simple"], merge_params={"simple": {"weights": [1, 3]}})) == []


def test_the_splits_a_run_reads_are_required(tmp_path):
    only_train_test = dataset(tmp_path / "tt", splits=("train", "test"))
    ds = [{"name": "crowdflower"}, {"name": "tt", "source": only_train_test}]
    assert check_run(config(datasets=ds)) == []  # no validation: the fine-tune holds out a slice of train, not test
    for change, why in [
        ({"select": "greedy"}, "greedy selection scores the models on it"),
        ({"evaluation": {"ood_heads": "reliable"}}, "evaluation.ood_heads: reliable rates each head on it"),
        ({"evaluation": {"split": "validation", "out_of_domain": []}}, "in-domain evaluation reads it"),
    ]:
        problems = check_run(config(datasets=ds, **change))
        assert len(problems) == 1 and problems[0].startswith(
            f"training dataset tt: no validation split in {only_train_test} (it has train, test); {why}"
        ), problems
    reliable = {"ood_heads": "reliable"}  # rates heads only for out-of-domain sets
    assert check_run(config(datasets=ds, evaluation=reliable | {"out_of_domain": []})) == []
    only_test = dataset(tmp_path / "t", splits=("test",))
    problems = check_run(config(datasets=[{"name": "crowdflower"}, {"name": "t", "source": only_test}]))
    assert problems == [
        f"training dataset t: no train split in {only_test} (it has test); the fine-tune trains on it — add "
        "train.jsonl there, or change the run config"
    ]
    only_train = dataset(tmp_path / "tr", splits=("train",))
    ds = [{"name": "crowdflower"}, {"name": "tr", "source": only_train}]
    # a fine-tune needs train alone (its epochs are scored on a slice held out of it); the evaluation needs test
    assert unevaluated(config(datasets=ds, evaluation={"in_domain": False, "out_of_domain": []})) == []
    assert check_run(config(datasets=ds, evaluation={"out_of_domain": []})) == [
        f"training dataset tr: no test split in {only_train} (it has train); in-domain evaluation reads it "
        "(evaluation.split: test) — add test.jsonl there, or change the run config"
    ]


def test_label_sets_the_run_cannot_score_are_refused(tmp_path):
    other = dataset(tmp_path / "colours", labels=("red", "blue"))
    ds = [{"name": "crowdflower"}, {"name": "colours", "source": other}]
    problems = check_run(config(datasets=ds))
    assert len(problems) == 2, problems  # one line per pair of training sets, one for the out-of-domain set
    assert problems[0].startswith("evaluation set colours: the head of crowdflower (anger, boredom, ") or problems[
        0
    ].startswith("evaluation set crowdflower: the head of colours (red, blue) shares no class with crowdflower")
    assert "— every model is scored on every training set: set evaluation.in_domain: false" in problems[0]
    assert problems[1].startswith(
        "evaluation set goemotions_ekman: the head of colours (red, blue) shares no class with goemotions_ekman"
    )
    assert problems[1].endswith("— every model is scored on it: drop goemotions_ekman from evaluation.out_of_domain "
                                "(or select_on)")  # fmt: skip
    assert unevaluated(config(datasets=ds, evaluation={"in_domain": False, "out_of_domain": []})) == []
    ner = dataset(tmp_path / "ner", labels=("B-x", "I-x", "O"), task="ner")
    problems = check_run(config(datasets=[{"name": "meld"}, {"name": "ner", "source": ner}], labels="union"))
    assert problems[0] == (
        "training dataset ner: labels: union needs classification datasets, ner is ner — use labels: per-dataset, "
        "or drop the dataset"
    ), problems


def test_a_training_set_of_one_class_is_refused_unless_the_head_is_a_union(tmp_path):
    joy = dataset(tmp_path / "joyful", labels=("joy",))
    ds = [{"name": "meld"}, {"name": "joyful", "source": joy}]
    problems = unevaluated(config(datasets=ds, evaluation={"in_domain": False, "out_of_domain": []}))
    assert problems == [
        f"training dataset joyful ({joy}): only one class (joy) — a classification head needs two or more to tell "
        "apart: add records of another class (and list it in meta.json's labels), or train with labels: union "
        "(--labels union)"
    ], problems
    union = config(datasets=ds, labels="union", evaluation={"in_domain": False, "out_of_domain": []})
    assert unevaluated(union) == []  # the union holds meld's classes beside joy


def _tiny_base(folder: Path) -> Path:
    """A tiny BERT of MiniLM's vocabulary, with MiniLM's tokenizer: what the tiny brought models fine-tune."""
    import shutil

    from symfuse.checkpoint import resolve_checkpoint
    from tests.tiny import save_tiny

    save_tiny(folder, "bert", vocab_size=30522)
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(resolve_checkpoint("minilm") / name, folder / name)
    return folder


def test_brought_checkpoints_are_read_and_their_heads_matched(tmp_path):
    from tests.tiny import save_tiny

    def tiny(folder, family, **kw):
        return save_tiny(folder, family, vocab_size=30522, **kw)

    base = str(_tiny_base(tmp_path / "base"))

    def on_base(**overrides):
        return config(**({"base_model": base} | overrides))

    unnamed = tiny(tmp_path / "unnamed", "bert", head="seq")  # LABEL_0..2
    ds = [{"name": "crowdflower"}, {"name": "meld", "checkpoint": str(unnamed)}]
    problems = check_run(on_base(datasets=ds))
    assert problems == [  # one line for the model, not one per evaluation set
        f"checkpoint of meld {unnamed}: its head has no class names (LABEL_0, LABEL_1, LABEL_2), and every evaluation "
        "set (goemotions_ekman, crowdflower, meld) scores it by class name — bring a checkpoint of meld whose "
        "config.json id2label names meld's classes"
    ]
    # not scored in domain, but its head refit reads meld's texts: refused unless allow_label_mismatch
    quiet = {"evaluation": {"in_domain": False, "out_of_domain": []}, "head_refit": {"enabled": True}}
    problems = unevaluated(on_base(datasets=ds, **quiet))
    assert problems == [
        f"checkpoint of meld {unnamed}: its head refit / RegMean++ statistics read meld, which has 7 classes for a "
        "head of 3 unnamed outputs — bring the checkpoint fine-tuned on meld, or set allow_label_mismatch: true"
    ]
    assert unevaluated(on_base(datasets=ds, allow_label_mismatch=True, **quiet)) == []
    # the empirical Fisher takes meld's classes as the head's targets: refused whatever allow_label_mismatch says
    fisher = {"strategies": ["fisher"], "allow_label_mismatch": True, "evaluation": quiet["evaluation"]}
    assert unevaluated(on_base(datasets=ds, **fisher)) == [
        f"checkpoint of meld {unnamed}: its Fisher statistics take meld's classes as targets: 7 classes for the 3 "
        "unnamed outputs of the head — bring the checkpoint fine-tuned on meld, or drop the fisher strategy"
    ]
    body = tiny(tmp_path / "body", "bert")  # no classification head at all
    problems = check_run(on_base(datasets=[{"name": "crowdflower"}, {"name": "meld", "checkpoint": str(body)}]))
    assert problems == [
        f"checkpoint of meld {body}: {body}/config.json: no classification head (architectures: BertModel) — bring "
        "a fine-tuned task model"
    ]
    missing = [{"name": "crowdflower"}, {"name": "meld", "checkpoint": str(tmp_path / "nowhere")}]
    problems = check_run(on_base(datasets=missing))
    assert len(problems) == 1 and problems[0].startswith(f"checkpoint of meld {tmp_path / 'nowhere'}: "), problems
    lora = tmp_path / "lora"  # an adapter where a model belongs: named as one, with the command that folds it
    lora.mkdir()
    (lora / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')
    problems = check_run(on_base(datasets=[{"name": "crowdflower"}, {"name": "meld", "checkpoint": str(lora)}]))
    assert problems == [
        f"checkpoint of meld {lora}: a PEFT adapter (adapter_config.json), not a model — fold it first: symfuse "
        f"merge-lora --adapters {lora} --base BASE --into-base --out OUT"
    ]
    (problem,) = check_run(on_base(base_model=str(lora)))  # as the base: its path named once too
    assert problem.startswith(f"base model {lora}: a PEFT adapter (adapter_config.json), not a model — "), problem
    uri = [{"name": "crowdflower"}, {"name": "meld", "checkpoint": "s3://bucket/meld"}]
    assert check_run(on_base(datasets=uri, store_root="s3://bucket")) == []  # read when the run brings it


def test_a_brought_checkpoint_the_run_cannot_merge_is_refused_before_anything_trains(tmp_path):
    """Another width, family or vocabulary, or a cut weights file: found at matching or merging, after the
    fine-tunes and statistics (22-34 s in a probe), and named by the store's copy."""
    from tests.tiny import save_tiny

    base = _tiny_base(tmp_path / "base")
    wide = save_tiny(tmp_path / "wide", "bert", head="seq", vocab_size=30522, hidden_size=64)
    cut = save_tiny(tmp_path / "cut", "bert", head="seq", vocab_size=30522)
    (cut / "model.safetensors").write_bytes((cut / "model.safetensors").read_bytes()[:5000])
    other = save_tiny(tmp_path / "other", "roberta", head="seq")
    for folder, words in [(wide, "shapes differ: 2 layers, d 64"), (cut, "model.safetensors: "),
                          (other, f"is a roberta model, the base {base} a bert model")]:  # fmt: skip
        ds = [{"name": "crowdflower"}, {"name": "meld", "checkpoint": str(folder)}]
        (problem,) = [p for p in check_run(config(datasets=ds, base_model=str(base))) if "head has no class" not in p]
        assert problem.startswith(f"checkpoint of meld {folder}: ") and words in problem, problem
    brought = [{"name": "crowdflower", "checkpoint": str(wide)}, {"name": "meld", "checkpoint": str(other)}]
    problems = check_run(config(datasets=brought, base_model=str(base)))  # nothing fine-tuned: the first is the
    assert any(f"the checkpoint of crowdflower {wide} a bert model" in p for p in problems), problems  # reference


def test_a_brought_uri_must_name_an_artifact_of_the_runs_store(tmp_path):
    """A URI outside the store root passed the checks; the run's bring task failed on it ("not a checkpoint
    folder") while the other fine-tunes trained on (68 s in a probe)."""
    from symfuse.store import ArtifactStore

    root = tmp_path / "store"
    fix = "give a local folder, a .gguf file, a hub id or an artifact of the run's store"
    missing = f"file://{root}/runs/u/models/meld"
    for uri, line in [
        ("s3://nobucket/x", f"s3://nobucket/x: not under the run's store root {root} — {fix} (download it first)"),
        (missing, f"{missing}: no complete artifact there (no manifest) — {fix}"),
    ]:
        ds = [{"name": "crowdflower"}, {"name": "meld", "checkpoint": uri}]
        assert check_run(config(datasets=ds, store_root=str(root))) == [f"checkpoint of meld {line}"]
    assert not root.exists()  # nothing created
    folder = save_tiny(tmp_path / "model", "bert", seed=0)
    ArtifactStore(str(root)).put_dir("runs/u/models/meld", folder, "test")
    stored = [{"name": "crowdflower"}, {"name": "meld", "checkpoint": f"file://{root}/runs/u/models/meld"}]
    assert check_run(config(datasets=stored, store_root=str(root))) == []


def test_probe_reads_only_the_first_records(tmp_path):
    folder = Path(dataset(tmp_path / "d"))
    with (folder / "train.jsonl").open("a") as fh:  # a bad line far down is the loader's to find, not the probe's
        fh.write("".join(json.dumps({"text": "t", "label": "joy"}) + "\n" for _ in range(100)) + "{not json\n")
    probe = probe_dataset(str(folder))
    assert probe.labels == ("anger", "joy") and probe.complete and probe.splits == ("train", "validation", "test")
    with pytest.raises(DatasetError, match=r"train\.jsonl:107: not valid JSON"):
        from symfuse.data import load_task_dataset

        load_task_dataset(str(folder))
    shutil.rmtree(folder)
    with pytest.raises(DatasetError, match="no dataset of that name"):
        probe_dataset("d_missing")
    assert probe_dataset("owner/hub-set").read is False  # hub datasets are read by the run
    assert probe_dataset("meld").where == str(BUNDLED_DIR / "meld")


def test_a_dataset_task_the_data_does_not_have_is_refused():
    (problem,) = check_run(config(datasets=[{"name": "crowdflower", "task": "regression"}, {"name": "meld"}]))
    assert problem.startswith("training dataset crowdflower: task: regression, but ") and problem.endswith(
        "holds classification data — fix task:, or drop it (meta.json says the task)"
    ), problem
    assert check_run(config(datasets=[{"name": "crowdflower", "task": "classification"}, {"name": "meld"}])) == []


def test_one_folder_trained_on_twice_with_the_same_settings_is_refused(tmp_path):
    """Two spellings of one folder under two names fine-tuned twins of one model and merged them as two."""
    data = dataset(tmp_path / "emo")
    (tmp_path / "link").symlink_to(tmp_path / "emo")
    for other in (data + "/", str(tmp_path / "link")):
        problems = check_run(config(datasets=[{"name": "a", "source": data}, {"name": "b", "source": other}]))
        assert problems == [
            f"training dataset b: reads {other.rstrip('/')}, as a does, with the same settings — its fine-tune would "
            "be a's twin; list the dataset once"
        ], problems
    capped = [{"name": "a", "source": data}, {"name": "b", "source": data, "max_train_examples": 4}]
    assert not any("twin" in p for p in check_run(config(datasets=capped)))  # another subset: another model
    # a training set held out under its own name: its model was scored "out of domain" on its own data
    alias = [{"name": "ekm", "source": "goemotions_ekman"}, {"name": "meld"}]
    problems = check_run(config(datasets=alias, evaluation={"out_of_domain": ["goemotions_ekman", "crowdflower"]}))
    assert [p for p in problems if "own data" in p] == [
        f"evaluation set goemotions_ekman: reads {find_named_dataset('goemotions_ekman')}, which training dataset ekm "
        "trains on — ekm's model would be scored out of domain on its own data; drop goemotions_ekman"
    ], problems


def test_an_out_of_domain_set_holding_a_training_sets_records_is_refused(tmp_path, monkeypatch):
    """Another folder whose test file copies training records: scored as the out-of-domain mean, exit 0."""
    import shutil

    meld = find_named_dataset("meld")
    leak = tmp_path / "leak"
    leak.mkdir()
    monkeypatch.setenv("SYMFUSE_DATASETS", str(tmp_path))
    shutil.copy2(meld / "meta.json", leak / "meta.json")
    rows = (meld / "train.jsonl").read_text().splitlines()
    (leak / "test.jsonl").write_text("\n".join(rows[:40]) + "\n")
    problems = check_run(config(evaluation={"out_of_domain": ["leak"]}))
    assert problems == [
        f"evaluation set leak: 40 of the 40 records of its test file {leak / 'test.jsonl'} are meld's — its models "
        "would be scored out of domain on data they trained on; drop leak, or remove those records from it"
    ], problems
    other = [json.dumps({"text": f"x{i}", "label": "joy"}) for i in range(30)]
    (leak / "test.jsonl").write_text("\n".join(rows[:10] + other) + "\n")
    assert check_run(config(evaluation={"out_of_domain": ["leak"]})) == []  # a quarter shared: allowed


def test_a_path_as_a_dataset_name_is_told_to_go_under_source():
    with pytest.raises(ValueError, match=r"dataset name '/data/toy' is a path — name it and give the path as its "
                                         r"source: \{name: toy, source: /data/toy\}"):  # fmt: skip
        config(datasets=[{"name": "/data/toy"}, {"name": "meld"}])


def test_the_probe_refuses_a_class_named_twice(tmp_path):
    folder = tmp_path / "cased"
    folder.mkdir()
    rows = [{"text": "t", "label": "Joy"}, {"text": "u", "label": "joy"}, {"text": "v", "label": "anger"}]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DatasetError, match=r"cased: the records spell one class two ways \('Joy' and 'joy'"):
        probe_dataset(str(folder))  # the run's pre-flight: before any model trains
    (folder / "meta.json").write_text(json.dumps({"task": "classification", "labels": ["Joy", "anger", "joy"]}))
    with pytest.raises(DatasetError, match=r"meta\.json: labels lists 'Joy' and 'joy' twice"):
        probe_dataset(str(folder))


def test_split_names_reads_no_record(tmp_path):
    folder = Path(dataset(tmp_path / "d", splits=("train", "test")))
    (folder / "train.jsonl").write_text("{not json\n")  # a probe would refuse it; the names do not read it
    assert split_names(str(folder)) == ("train", "test")
    assert split_names("owner/hub-set") is None and split_names("hf:owner/hub-set") is None
    with pytest.raises(DatasetError, match="no dataset of that name"):
        split_names("d_missing")


def test_a_store_root_of_an_unknown_users_home_is_a_plain_path(tmp_path, monkeypatch):
    """``~nosuchuser/runs`` raised RuntimeError from Path.expanduser: a traceback without -v."""
    from symfuse.store.roots import store_root_problem

    monkeypatch.chdir(tmp_path)
    assert store_root_problem("~nosuchuser-probe/runs", "store_root", "fix") is None  # created under ./, as bash does


def test_a_store_root_the_file_system_refuses_is_named_before_anything_trains(tmp_path, monkeypatch):
    """store_root /sys/kernel/x passed as root; the fine-tunes ran, then failed with 'check the AWS_* credentials'."""
    import tempfile

    from symfuse.store.roots import store_root_problem

    odd, real = tmp_path / "odd", tempfile.mkstemp
    odd.mkdir()

    def mkstemp(*a, dir=None, **kw):
        if str(dir) == str(odd):
            raise PermissionError(13, "Permission denied")
        return real(*a, dir=dir, **kw)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    assert store_root_problem(str(odd / "runs"), "store_root", "fix") == (
        f"store_root {odd / 'runs'}: no file can be created in {odd} (Permission denied) — fix"
    )
    assert store_root_problem(str(tmp_path / "runs"), "store_root", "fix") is None
    assert not list(odd.iterdir())


def test_a_hub_dataset_the_machine_cannot_read_offline_is_refused(monkeypatch):
    """``python -m flows`` turns hub access off; a hub dataset passed the pre-flight and failed in its fine-tune."""
    from datasets import config as datasets_config

    monkeypatch.setattr(datasets_config, "HF_HUB_OFFLINE", True)
    datasets = [{"name": "meld"}, {"name": "hub", "source": "someone/not-cached"}]
    (problem,) = check_run(config(datasets=datasets, strategies=["simple"]))
    assert problem.startswith("training dataset hub: someone/not-cached: a hub dataset, but hub "
                              "access is off here"), problem  # fmt: skip
    assert problem.endswith("or set HF_DATASETS_OFFLINE=0 where the hub is reachable"), problem
    monkeypatch.setattr(datasets_config, "HF_HUB_OFFLINE", False)  # online: the run reads it (nothing asked here)
    assert check_run(config(datasets=datasets, strategies=["simple"])) == []


def test_a_dataset_source_that_is_not_there_is_named_with_its_path(tmp_path):
    """'training dataset mine: no such dataset folder or file' named neither the path nor the fix."""
    missing = tmp_path / "no" / "such"
    datasets = [{"name": "meld"}, {"name": "mine", "source": str(missing)}]
    (problem,) = check_run(config(datasets=datasets, strategies=["simple"]))
    assert problem.startswith(f"training dataset mine ({missing}): no such dataset folder or file — check the path")
