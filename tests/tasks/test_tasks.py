"""Task bodies called with ``.fn()`` (no Prefect run): idempotency by content, OOM batch split, head choice."""

from __future__ import annotations

import json
import shutil
import uuid

import pytest
import torch
from safetensors.torch import load_file

import symfuse.stats
import tasks.finetune
from symfuse.checkpoint import default_base_model
from symfuse.config import RunConfig
from symfuse.store import ArtifactStore, CorruptArtifact, layout
from tasks import policy
from tasks.common import fetch
from tasks.evaluate import describe
from tasks.finetune import bring_checkpoint, finetune
from tasks.housekeeping import clean_store
from tasks.stats import collect_stats
from tests.tiny import save_tiny, save_tiny_text_classifier

TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """Tiny BERT without dropout (so split micro-batches give the same updates), MiniLM tokenizer."""
    folder = save_tiny(tmp_path_factory.mktemp("b") / "bert", "bert", vocab_size=30522, max_position_embeddings=64,
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # fmt: skip
    for name in TOKENIZER_FILES:
        shutil.copy2(default_base_model() / name, folder / name)
    return folder


def config(base, root, **kw) -> RunConfig:
    data = {
        "run_id": "u",
        "base_model": str(base),
        "datasets": [{"name": "isear", "max_train_examples": 32, "max_eval_examples": 16}],
        "finetune": {"epochs": 1, "lr": 1e-3, "batch_size": 16, "max_length": 24},
        "stats": {"kinds": ["gram"], "max_examples": 8, "batch_size": 4},
        "anchor": "isear",
        "device": "cpu",
        "store_root": root,
    }
    return RunConfig.model_validate(data | kw)


def _count(monkeypatch, module, name):
    calls = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_finetune_and_stats_are_idempotent_by_content(base, tmp_path, monkeypatch):
    cfg = config(base, str(tmp_path / "store"))
    trained = _count(monkeypatch, tasks.finetune, "finetune_model")
    collected = _count(monkeypatch, symfuse.stats, "collect_stats")
    uri = finetune.fn(cfg, "isear")
    assert uri == ArtifactStore(cfg.resolved_store_root()).uri(layout.model_key("u", "isear"))
    assert finetune.fn(cfg, "isear") == uri and len(trained) == 1  # same content key: reused
    s1 = collect_stats.fn(cfg, "isear", uri, "gram")
    assert collect_stats.fn(cfg, "isear", uri, "gram") == s1 and len(collected) == 1
    more = cfg.model_copy(update={"stats": cfg.stats.model_copy(update={"max_examples": 12})})
    collect_stats.fn(more, "isear", uri, "gram")  # another setting: recomputed under the same key
    assert len(collected) == 2
    store = ArtifactStore(cfg.resolved_store_root())
    assert store.manifest(s1)["meta"]["stage"] == "collect_stats" and store.manifest(s1)["inputs"] == {"model": uri}


def test_a_dataset_whose_records_changed_is_trained_and_collected_again(base, tmp_path, monkeypatch):
    """The name or path alone keyed the data: new records under one path reused the old fine-tune, its statistics
    and evaluations, with exit 0 (a table of the old data)."""
    from tasks.stats import stats_settings
    from tests.cli.helpers import toy_dataset

    data = toy_dataset(tmp_path / "emo")
    cfg = config(base, str(tmp_path / "store"), datasets=[{"name": "emo", "source": str(data)}], anchor="emo")
    trained = _count(monkeypatch, tasks.finetune, "finetune_model")
    first, settings = finetune.fn(cfg, "emo"), stats_settings(cfg, "emo", "gram")
    assert finetune.fn(cfg, "emo") == first and len(trained) == 1  # the same records: reused
    rows = (data / "train.jsonl").read_text().splitlines()
    (data / "train.jsonl").write_text("\n".join(rows[::-1][:6]) + "\n")  # other records, same path and name
    store = ArtifactStore(cfg.resolved_store_root())
    version = store.manifest(first)["version"]
    assert finetune.fn(cfg, "emo") == first and len(trained) == 2  # trained again, a new version under the key
    assert store.manifest(first)["version"] != version and stats_settings(cfg, "emo", "gram") != settings


def test_oom_split_gives_the_same_model(base, tmp_path, monkeypatch):
    cfg = config(base, f"memory://u-{uuid.uuid4().hex[:8]}")
    monkeypatch.setenv("SYMFUSE_CACHE", str(tmp_path / "cache"))
    store = ArtifactStore(cfg.resolved_store_root())
    whole = load_file(fetch(store, finetune.fn(cfg, "isear")) / "model.safetensors")
    store.delete(layout.model_key("u", "isear"))
    monkeypatch.setattr(policy, "oom_count", lambda: 1)  # as after one out-of-memory failure: 8 x 2 instead of 16 x 1
    uri = finetune.fn(cfg, "isear")
    assert store.manifest(uri)["meta"]["micro_batch"] == 8
    split = load_file(fetch(store, uri) / "model.safetensors")
    for name, t in whole.items():
        torch.testing.assert_close(split[name], t, rtol=1e-4, atol=1e-5, msg=name)


def test_a_dataset_without_validation_is_fine_tuned_on_held_out_train_records_and_keyed_apart(base, tmp_path):
    # the pipeline's fine-tune scores its epochs on a slice held out of train (never on the test split it is then
    # evaluated on), and its content key says so: a model stored when such epochs were scored on test is not reused;
    # a dataset with a validation split keeps the key it always had
    import json

    from symfuse.data.probe import content_fingerprint
    from symfuse.stats import files_fingerprint
    from symfuse.store.layout import content_key
    from tasks.finetune import finetune_keys, finetune_settings
    from tests.symfuse.train.helpers import no_validation_dataset

    nv = no_validation_dataset(tmp_path / "nv", 20)
    cfg = config(base, str(tmp_path / "store"), datasets=[{"name": "nv", "source": str(nv)}, {"name": "isear"}],
                 anchor="nv")  # fmt: skip

    def key_before(name):
        data = cfg.dataset(name).data
        what = {"finetune": finetune_settings(cfg, name), "data": data, "records": content_fingerprint(data)}
        return content_key(what, {"base": files_fingerprint(base)})

    assert finetune_keys(cfg, "isear")[1] == key_before("isear") and finetune_keys(cfg, "nv")[1] != key_before("nv")
    report = json.loads((fetch(ArtifactStore(cfg.resolved_store_root()), finetune.fn(cfg, "nv")) /
                         "symfuse_train.json").read_text())  # fmt: skip
    assert report["selection"]["split"] == "train_holdout" and report["selection"]["held_out_of_train"] == 2
    assert {e["split"] for e in report["epochs"]} == {"train_holdout"}


def test_bring_checkpoint_from_folder(base, tmp_path):
    """The checkpoint's files are stored; a training folder's checkpoint-*/ and optimizer state stay behind."""
    brought = shutil.copytree(base, tmp_path / "trained")
    (brought / "checkpoint-500").mkdir()
    (brought / "checkpoint-500" / "optimizer.pt").write_bytes(b"\0" * 4096)
    (brought / "training_args.bin").write_bytes(b"\0" * 64)
    cfg = config(base, str(tmp_path / "store"), datasets=[{"name": "isear", "checkpoint": str(brought)}])
    uri = bring_checkpoint.fn(cfg, "isear")
    store = ArtifactStore(cfg.resolved_store_root())
    got = fetch(store, uri)
    assert (got / "model.safetensors").read_bytes() == (base / "model.safetensors").read_bytes()
    assert sorted(p.name for p in got.iterdir() if p.name != "manifest.json") == sorted(p.name for p in base.iterdir())
    assert bring_checkpoint.fn(cfg, "isear") == uri
    with pytest.raises(ValueError, match="no checkpoint to bring"):
        bring_checkpoint.fn(config(base, str(tmp_path / "store")), "isear")


def test_a_damaged_published_record_stops_the_run_at_its_first_task(base, tmp_path):
    cfg = config(base, str(tmp_path / "store"))
    assert clean_store.fn(cfg) == []  # a new run: nothing published yet
    store = ArtifactStore(cfg.resolved_store_root())
    key = layout.published_key(cfg.run_id)
    store.put_json(key, {"merged": {}}, "publish")
    clean_store.fn(cfg)  # a whole record is read and kept
    assert store.get_json(key) == {"merged": {}}
    store.fs.pipe_file(store._path(key, layout.MANIFEST), b"{not json")  # publish, the run's last task, fails on it
    with pytest.raises(CorruptArtifact, match=r"published/manifest\.json is not valid JSON; delete and recompute it"):
        clean_store.fn(cfg)
    assert not policy.is_transient(CorruptArtifact("x"))  # and it fails once, not three times


def test_statistics_of_another_model_are_told_in_the_pipeline_s_terms(base, tmp_path):
    from symfuse.errors import StatsMismatchError
    from tasks.merge import merge

    other = save_tiny(tmp_path / "other", "bert", vocab_size=30522, max_position_embeddings=64, seed=5)
    for name in TOKENIZER_FILES:
        shutil.copy2(base / name, other / name)
    datasets = [{"name": "isear", "checkpoint": str(base), "max_train_examples": 16},
                {"name": "meld", "checkpoint": str(other), "max_train_examples": 16}]  # fmt: skip
    cfg = config(base, str(tmp_path / "store"), datasets=datasets)
    models = {n: bring_checkpoint.fn(cfg, n) for n in ("isear", "meld")}
    isear_stats = collect_stats.fn(cfg, "isear", models["isear"], "gram")
    with pytest.raises(StatsMismatchError) as info:  # meld's statistics replaced by isear's in the store
        merge.fn(cfg, "regmean", "plain", models, {"isear": [isear_stats], "meld": [isear_stats]})
    line = str(info.value)
    assert f"not on {models['meld']} (fingerprint" in line, line  # the store's URI, not the task's scratch folder
    assert line.endswith("delete that statistics artifact and run again (the run collects it anew)"), line
    assert "--models" not in line and "symfuse stats" not in line and "scratch" not in line


def test_describe(base, tmp_path):
    cfg = config(base, str(tmp_path))
    assert describe(cfg, "isear") == ("individual", "isear")
    assert describe(cfg, "task-arithmetic-matched") == ("task-arithmetic", "matched")


def _record_progress(monkeypatch, module, name):
    """Spy on a library entry point: the fractions its ``on_progress`` callback receives, per call."""
    runs: list[list[float]] = []
    real = getattr(module, name)

    def spy(*args, on_progress=None, **kwargs):
        seen: list[float] = []
        runs.append(seen)

        def record(fraction):
            seen.append(fraction)
            on_progress(fraction)

        return real(*args, on_progress=record if on_progress is not None else None, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return runs


def test_progress_reaches_one_and_a_reused_result_says_so(base, tmp_path, monkeypatch, caplog):
    import tasks.evaluate
    from tasks.evaluate import evaluate

    cfg = config(base, str(tmp_path / "store"), stats={"kinds": ["gram", "fisher"], "max_examples": 8, "batch_size": 4})
    trained = _record_progress(monkeypatch, tasks.finetune, "finetune_model")
    collected = _record_progress(monkeypatch, symfuse.stats, "collect_stats")
    evaluated = _record_progress(monkeypatch, tasks.evaluate, "evaluate_model")
    with caplog.at_level("INFO"):
        uri = finetune.fn(cfg, "isear")
        collect_stats.fn(cfg, "isear", uri, "gram")
        evaluate.fn(cfg, "isear", uri, "isear")
    # 32 examples, batch 16, 1 epoch: 2 optimizer steps; 8 examples in batches of 4: 2 batches; 16 eval examples
    # in batches of 64: 1 batch
    assert trained == [[0.5, 1.0]] and collected == [[0.5, 1.0]] and evaluated == [[1.0]]
    lines = [r.getMessage() for r in caplog.records]
    assert any(r.name == "symfuse.train.finetune" and r.getMessage().startswith("epoch 1: train loss")
               for r in caplog.records)  # fmt: skip
    assert "gram statistics: batch 2/2" in lines
    assert not any(line.startswith("reused stored") for line in lines)

    caplog.clear()
    with caplog.at_level("INFO"):
        assert finetune.fn(cfg, "isear") == uri
    store = ArtifactStore(cfg.resolved_store_root())
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("reused stored")]
    assert line.startswith(f"reused stored fine-tuned model isear at {uri} (key ")
    assert store.manifest(uri)["content_key"][:16] in line
    assert len(trained) == 1  # nothing trained the second time


def test_merge_with_head_refit_rewrites_each_head_and_is_its_own_content(base, tmp_path):
    import json

    from symfuse.merge import REPORT
    from tasks.merge import merge
    from tasks.report import head_refit_fact

    datasets = [{"name": n, "max_train_examples": 32, "max_eval_examples": 16} for n in ("isear", "meld")]
    plain = config(base, str(tmp_path / "store"), datasets=datasets)
    refit = plain.model_copy(update={"head_refit": plain.head_refit.model_copy(update={"enabled": True})})
    models = {n: finetune.fn(plain, n) for n in ("isear", "meld")}
    store = ArtifactStore(plain.resolved_store_root())
    kept = merge.fn(plain, "simple", "plain", models, {})
    kept_ck = store.manifest(kept)["content_key"]
    kept_heads = {rel: load_file(fetch(store, kept) / rel / "model.safetensors") for rel in (".", "heads/meld")}
    uri = merge.fn(refit, "simple", "plain", models, {})
    assert store.manifest(uri)["content_key"] != kept_ck  # the option is part of the content: re-merged
    folder = fetch(store, uri)
    report = json.loads((folder / REPORT).read_text())["heads"]["refit"]
    assert set(report["heads"]) == {".", "heads/meld"} and report["ridge"] == refit.head_refit.ridge
    for rel, head in report["heads"].items():
        assert head["rows"] == 8 and head["logit_mse_after"] < head["logit_mse_before"]
        new = load_file(folder / rel / "model.safetensors")
        assert not torch.equal(new["classifier.weight"], kept_heads[rel]["classifier.weight"])
        body = [k for k in new if not k.startswith("classifier")]
        assert all(torch.equal(new[k], kept_heads[rel][k]) for k in body)  # the merged body is untouched
    meta = store.manifest(uri)["meta"]["head_refit"]
    assert meta == {rel: [h["logit_mse_before"], h["logit_mse_after"]] for rel, h in report["heads"].items()}
    fact = head_refit_fact([{"stage": "finetune"}, store.manifest(uri)["meta"]], 0.1)
    mean = [sum(p[i] for p in meta.values()) / 2 for i in (0, 1)]
    want = f"logit MSE to each dataset's own model {mean[0]:.4g} -> {mean[1]:.4g} (mean over 2 merged heads)"
    assert fact == f"ridge 0.1; {want}"
    assert head_refit_fact([{"stage": "merge"}], 0.1) is None  # refit off: no line in the report
    again = merge.fn(plain, "simple", "plain", models, {})  # off again: the content key merges had before the option
    assert store.manifest(again)["content_key"] == kept_ck
    # refit limited to other strategies' merges: this one is the plain merge again
    only = refit.model_copy(update={"head_refit": refit.head_refit.model_copy(update={"strategies": ["regmean"]})})
    assert store.manifest(merge.fn(only, "simple", "plain", models, {}))["content_key"] == kept_ck
    assert only.head_refit.applies("regmean") and not only.head_refit.applies("simple")


def test_out_of_domain_the_most_reliable_head_answers_alone(base, tmp_path):
    """``ood_heads: reliable``: every head sharing a class is rated on its own validation split; the best one is
    scored alone on the OOD test set and the record keeps the ratings. It is a content of its own (vote differs)."""
    from symfuse.evaluate import evaluate_model
    from symfuse.evaluate.reliable import rate_heads
    from tasks.evaluate import evaluate
    from tasks.merge import merge

    datasets = [{"name": n, "max_train_examples": 32, "max_eval_examples": 16} for n in ("isear", "meld")]
    voting = config(base, str(tmp_path / "store"), datasets=datasets, evaluation={"max_examples": 24})
    reliable = voting.model_copy(update={"evaluation": voting.evaluation.model_copy(update={"ood_heads": "reliable"})})
    models = {n: finetune.fn(voting, n) for n in ("isear", "meld")}
    store = ArtifactStore(voting.resolved_store_root())
    uri = merge.fn(voting, "simple", "plain", models, {})
    folder = fetch(store, uri)
    heads = {n: folder / rel for n, rel in store.manifest(uri)["meta"]["heads"].items()}
    record = store.get_json(evaluate.fn(reliable, "simple-plain", uri, "goemotions_ekman"))
    how = dict(max_examples=24, max_length=24, seed=voting.finetune.seed)
    six = ["anger", "disgust", "fear", "joy", "sadness", "surprise"]  # the set's classes in isear + meld's union
    target = ["anger", "disgust", "fear", "joy", "neutral", "sadness", "surprise"]
    want = rate_heads(heads, {"isear": "isear", "meld": "meld"}, target, scored=six, **how)
    assert record["head_rating"] == {"split": "validation", "scores": pytest.approx(want, abs=1e-12)}
    best = max(want, key=want.get)
    assert record["head"] == best
    alone = evaluate_model(heads[best], "goemotions_ekman", out_file=tmp_path / "m.json", in_domain=False,
                           scored=six, **how)  # fmt: skip
    assert record["metrics"]["macro_f1"] == pytest.approx(alone["macro_f1"], abs=1e-12)
    assert record["metrics"]["classes"] == six  # every model of the run is scored over the same classes
    voted = store.get_json(evaluate.fn(voting, "simple-plain", uri, "goemotions_ekman"))
    assert voted["head"] == "isear+meld" and "head_rating" not in voted and voted["metrics"]["classes"] == six
    # isear's own model lacks surprise: scored over the six all the same, surprise at F1 0
    own = store.get_json(evaluate.fn(voting, "isear", models["isear"], "goemotions_ekman"))
    assert own["metrics"]["classes"] == six and own["metrics"]["per_class_f1"]["surprise"] == 0.0
    _a_stopped_run_ends_its_vote_and_merge_at_their_first_step(voting, uri, models)


def _a_stopped_run_ends_its_vote_and_merge_at_their_first_step(voting, uri, models):
    """A Ctrl-C / SIGTERM of the pipeline (stop_running_tasks) ends a voting evaluation at its next batch and a
    merge at its next tensor (both ran to their end)."""
    from prefect import flow

    from tasks.common import RunStopped, stop_running_tasks
    from tasks.evaluate import evaluate
    from tasks.merge import merge

    other = voting.model_copy(update={"evaluation": voting.evaluation.model_copy(update={"max_examples": 20})})

    @flow
    def stopped(step):
        stop_running_tasks()
        return step()

    for name, step in (
        ("eval-simple-plain-goemotions_ekman", lambda: evaluate(other, "simple-plain", uri, "goemotions_ekman")),
        ("merge-task-arithmetic-plain", lambda: merge(voting, "task-arithmetic", "plain", models, {})),
    ):
        with pytest.raises(RunStopped, match=f"{name}: its run was stopped; ended at 0 %"):
            stopped(step)


def test_a_loss_path_between_heads_naming_their_classes_differently_is_recorded_skipped(base, tmp_path):
    """Same head shape, the classes in two orders: no straight path (it was scored by position); the record says so."""
    from tasks.paths import loss_paths

    store = ArtifactStore(str(tmp_path / "store"))
    uris = {}
    for name, labels in (("anchor", ["anger", "joy"]), ("model", ["joy", "anger"])):
        folder = save_tiny_text_classifier(tmp_path / name, seed=len(uris))
        cfg = json.loads((folder / "config.json").read_text())
        cfg |= {"id2label": dict(enumerate(labels)), "label2id": {n: i for i, n in enumerate(labels)}}
        (folder / "config.json").write_text(json.dumps(cfg))
        uris[name] = store.put_dir(f"runs/u/models/{name}", folder, "test")
    inspection = store.put_json("runs/u/inspect", {"pairs": [{"model": "isear", "verdict": "align-first"}]}, "test")
    cfg = config(base, str(tmp_path / "store"))
    uri = loss_paths.fn(cfg, "isear", uris["model"], uris["anchor"], uris["model"], inspection)
    record = store.get_json(uri)
    assert record["model"] == "isear" and "plain" not in record, record
    assert record["skipped"].startswith("the anchor and isear: their heads name their classes differently (anger, joy")


def test_publishing_names_merged_models_an_earlier_run_of_the_id_left(base, tmp_path, caplog):
    """Re-run with fewer strategies, runs/<id>/merged/regmean stayed current and readable without a word, made from
    the earlier run's models."""
    from tasks.publish import publish_run

    cfg = config(base, str(tmp_path / "store"))
    store = ArtifactStore(cfg.resolved_store_root())
    model = store.put_json(layout.model_key("u", "isear"), {"model": 1}, "finetune")
    old = store.put_json(layout.merged_key("u", "regmean", "plain"), {"merged": "earlier"}, "merge")
    new = store.put_json(layout.merged_key("u", "simple", "plain"), {"merged": "now"}, "merge", stage=True)
    report = store.put_json(layout.report_key("u"), {"report": 1}, "report", stage=True)
    with caplog.at_level("WARNING"):
        publish_run.fn(cfg, {"isear": model}, {"simple-plain": new}, report)
    (line,) = [r.getMessage() for r in caplog.records if "earlier run" in r.getMessage()]
    assert store.key(old) in line and "merged/simple" not in line
    assert store.get_json(old) == {"merged": "earlier"}  # kept: not this run's to delete
