"""``symfuse drop`` puts a validated checkpoint where the watcher looks; a plain copy gets a warning, not silence."""

from __future__ import annotations

import shutil

from flows.watch import pending_checkpoints, warn_unmarked
from symfuse.store import ArtifactStore, layout
from tests.cli.helpers import run_cli
from tests.tiny import nan_copy
from tests.tiny import save_tiny as _save_tiny


def save_tiny(folder, family, **kw):
    """A tiny checkpoint with a tokenizer (drop refuses one without: the run evaluates what it takes)."""
    from symfuse.checkpoint import resolve_checkpoint

    folder = _save_tiny(folder, family, **kw)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt"):
        shutil.copy2(resolve_checkpoint("minilm") / name, folder / name)
    return folder


def test_drop_stores_the_checkpoint_for_the_watcher(tmp_path):
    ckpt = save_tiny(tmp_path / "ckpt", "bert", seed=3)
    (ckpt / "symfuse_train.json").write_text("{}")  # its fine-tuning record travels (a merge's model card reads it)
    own = sorted(p.name for p in ckpt.iterdir())
    (ckpt / "checkpoint-500").mkdir()  # a Trainer's folder: intermediate checkpoints, optimizer state, logs
    (ckpt / "checkpoint-500" / "optimizer.pt").write_bytes(b"\0" * 4096)
    (ckpt / "runs.log").write_text("step 500\n")
    root = tmp_path / "store"
    res = run_cli("drop", ckpt, "--run", "r1", "--dataset", "meld", "--store", root)
    assert res.returncode == 0, res.stderr
    store = ArtifactStore(str(root))
    key = layout.incoming_key("r1", "meld")
    assert f"as {store.uri(key)} (dataset meld)" in res.stdout
    manifest = store.manifest(key)
    assert manifest["meta"] == {"dataset": "meld"} and manifest["producer"] == "symfuse drop"
    stored = store.local_cache(key)
    assert (stored / "model.safetensors").read_bytes() == (ckpt / "model.safetensors").read_bytes()
    assert sorted(p.name for p in stored.iterdir() if p.name != "manifest.json") == own  # only the checkpoint
    assert pending_checkpoints(store, "r1") == [store.uri(key)]

    again = run_cli("drop", ckpt, "--run", "r1", "--dataset", "meld", "--store", root)
    assert again.returncode == 2 and again.stderr.strip().splitlines()[-1].endswith(
        f"{store.uri(key)} exists; pass --replace to publish a new version of it, or another --name"
    ), again.stderr
    assert store.manifest(key) == manifest
    named = run_cli("drop", ckpt, "--run", "r1", "--name", "meld-seed3", "--store", root)
    assert named.returncode == 0, named.stderr
    assert store.manifest(layout.incoming_key("r1", "meld-seed3"))["meta"] == {"dataset": "meld-seed3"}


def test_drop_refuses_a_broken_checkpoint_before_touching_the_store(tmp_path):
    bad = nan_copy(save_tiny(tmp_path / "ckpt", "bert"), tmp_path / "nan")
    res = run_cli("drop", bad, "--run", "r1", "--store", tmp_path / "store")
    assert res.returncode == 1
    (line,) = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert line.startswith("error: ") and "nan" in line.lower(), res.stderr
    assert not (tmp_path / "store").exists()


def test_a_plain_copy_in_incoming_is_named_in_a_warning_not_ignored_silently(tmp_path):
    store = ArtifactStore(str(tmp_path / "store"))
    ckpt = save_tiny(tmp_path / "ckpt", "bert")
    store.put_dir(layout.incoming_key("r1", "good"), ckpt, "test")
    shutil.copytree(ckpt, tmp_path / "store" / layout.incoming_key("r1", "copied"))
    warnings = []
    found = warn_unmarked(store, "r1", None, lambda msg, *args: warnings.append(msg % args))
    copied = store.uri(layout.incoming_key("r1", "copied"))
    assert found == [copied]
    (line,) = warnings
    assert line.startswith(f"{copied} has no manifest.json") and "symfuse drop <checkpoint folder> --run r1" in line
    assert pending_checkpoints(store, "r1") == [store.uri(layout.incoming_key("r1", "good"))]
    assert warn_unmarked(ArtifactStore(str(tmp_path / "empty")), "r1", None, warnings.append) == []


def test_a_run_the_store_has_no_record_of_is_refused_while_a_new_store_takes_any_run(tmp_path):
    ckpt = save_tiny(tmp_path / "ckpt", "bert", seed=3)
    root = tmp_path / "store"
    store = ArtifactStore(str(root))  # a store with two runs (a fresh store takes a first one: see above)
    for run in ("r1", "r2"):
        store.put_dir(layout.model_key(run, "meld"), ckpt, "test")
    res = run_cli("drop", ckpt, "--run", "r1x", "--store", root)
    assert res.returncode == 2, res.stderr
    (line,) = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert line == (
        f"error: --run r1x: the store {store.root} has no run r1x (its runs: r1, r2) — check "
        "--run, or start the run first: python -m flows --config RUN.yaml --run-id r1x"
    ), res.stderr
    assert sorted(p.name for p in (root / "runs").iterdir()) == ["r1", "r2"]
    assert run_cli("drop", ckpt, "--run", "r2", "--name", "n", "--dataset", "meld", "--store", root).returncode == 0


def test_a_store_root_that_is_a_file_is_refused_in_one_line(tmp_path):
    ckpt = save_tiny(tmp_path / "ckpt", "bert", seed=3)
    notes = tmp_path / "notes.txt"
    notes.write_text("not a store\n")
    for root, what in ((notes, "is a file"), (notes / "store", f"is under {notes}, which is a file")):
        res = run_cli("drop", ckpt, "--run", "r1", "--store", root)
        assert res.returncode == 2, res.stderr
        (line,) = [ln for ln in res.stderr.splitlines() if ln.strip()]
        assert line == (
            f"error: --store {root}: {what} — give a folder (created if missing) or a URL such as s3://bucket/prefix"
        ), res.stderr
    assert notes.read_text() == "not a store\n"


def test_a_store_inside_the_checkpoint_is_refused_and_nothing_is_copied(tmp_path):
    ckpt = save_tiny(tmp_path / "ckpt", "bert", seed=3)
    before = sorted(p.name for p in ckpt.iterdir())
    res = run_cli("drop", ckpt, "--run", "r1", "--store", ckpt / "store")  # each drop copied the store into itself
    assert res.returncode == 2, res.stderr
    (line,) = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert line.startswith("error: --store file://") and line.endswith(
        f"/ckpt/store: inside CHECKPOINT {ckpt}, so the drop would copy the store into itself — keep the store "
        "outside the checkpoint folder"
    ), line
    assert sorted(p.name for p in ckpt.iterdir()) == before


def test_an_in_memory_store_is_refused_since_it_ends_with_the_command(tmp_path):
    ckpt = save_tiny(tmp_path / "ckpt", "bert", seed=3)
    res = run_cli("drop", ckpt, "--run", "r1", "--store", "memory://probe")  # exit 0, and the watcher saw nothing
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip() == (
        "error: --store memory://probe: an in-memory store ends with this process, and everything the command stores "
        "with it — give a local folder, file://PATH or s3://bucket/prefix"
    )
    for url in ("http://example.com/store", "zip://store.zip"):  # read-only: the upload failed after validation
        res = run_cli("drop", ckpt, "--run", "r1", "--store", url)
        assert res.returncode == 2 and res.stderr.strip() == (
            f"error: --store {url}: {url.partition(':')[0]}:// can only be read, and the store is written — give a "
            "local folder, file://PATH or s3://bucket/prefix"
        ), res.stderr


def test_a_checkpoint_of_another_shape_than_the_run_s_models_is_refused(tmp_path):
    root = tmp_path / "store"
    store = ArtifactStore(str(root))
    run_model = save_tiny(tmp_path / "run-model", "bert", seed=1)
    store.put_dir(layout.model_key("r1", "meld"), run_model, "finetune")  # the run fine-tuned meld's model
    gpt = save_tiny(tmp_path / "gpt", "gpt2", seed=3)
    wide = save_tiny(tmp_path / "wide", "bert", seed=3, hidden_size=64)
    words = save_tiny(tmp_path / "words", "bert", seed=3, vocab_size=80)  # its embeddings could not be merged
    for ckpt in (gpt, wide, words):
        res = run_cli("drop", ckpt, "--run", "r1", "--dataset", "meld", "--store", root)
        assert res.returncode == 2, res.stderr  # exit 0 before: the watcher's re-merge failed later
        (line,) = [ln for ln in res.stderr.splitlines() if ln.strip()]
        assert line.startswith(f"error: CHECKPOINT {ckpt}: a ") and " — run r1's model meld is a bert model (d " in line
        assert line.endswith("the re-merge could not use it: drop a fine-tune of the run's base model"), line
    assert not store.exists(layout.incoming_key("r1", "meld"))
    same = run_cli("drop", save_tiny(tmp_path / "same", "bert", seed=3), "--run", "r1", "--dataset", "meld",
                   "--store", root)  # fmt: skip
    assert same.returncode == 0, same.stderr


def test_a_checkpoint_without_a_tokenizer_is_refused(tmp_path):
    """The run evaluates every model it takes: a drop without tokenizer files failed there, after 'dropped'."""
    ckpt = _save_tiny(tmp_path / "ckpt", "bert", seed=3)
    res = run_cli("drop", ckpt, "--run", "r1", "--dataset", "meld", "--store", tmp_path / "store")
    assert res.returncode == 1 and f"{ckpt}: no tokenizer files" in res.stderr, res.stderr
    assert not (tmp_path / "store").exists() or not ArtifactStore(str(tmp_path / "store")).exists(
        layout.incoming_key("r1", "meld")
    )


def _run_with_models(tmp_path, *datasets):
    """A store whose run r1 fine-tuned a bert model for each of ``datasets``."""
    root = tmp_path / "store"
    store = ArtifactStore(str(root))
    model = save_tiny(tmp_path / "run-model", "bert", seed=1)
    for name in datasets:
        store.put_dir(layout.model_key("r1", name), model, "finetune")
    return root, store


def test_a_dataset_the_re_merge_could_not_find_is_refused_before_the_upload(tmp_path):
    # exit 0 before: the watcher's re-merge then failed on a dataset of the folder's or --name's name
    root, store = _run_with_models(tmp_path, "meld", "isear")
    ckpt = save_tiny(tmp_path / "my-finetune", "bert", seed=3)
    for args, given in (([], "the folder's name my-finetune (the dataset"), (["--name", "meld-seed3"], "--name meld-"),
                        (["--dataset", "mled"], "--dataset mled: ")):  # fmt: skip
        res = run_cli("drop", ckpt, "--run", "r1", "--store", root, *args)
        assert res.returncode == 2, res.stderr
        (line,) = [ln for ln in res.stderr.splitlines() if ln.strip()]
        assert line.startswith(f"error: {given}"), line
        assert "run r1 has no model of that dataset (its datasets: isear, meld)" in line, line
        assert "no dataset of that name" in line, line
    assert store.folders(layout.incoming_prefix("r1")) == []
    named = run_cli("drop", ckpt, "--run", "r1", "--name", "meld-seed3", "--dataset", "meld", "--store", root)
    assert named.returncode == 0, named.stderr  # a run dataset: a model of meld besides the run's
    new = run_cli("drop", ckpt, "--run", "r1", "--dataset", "goemotions", "--store", root)  # one found here
    assert new.returncode == 0, new.stderr


def test_a_run_model_s_name_for_another_dataset_is_refused_and_more_models_of_one_dataset_taken(tmp_path):
    root, store = _run_with_models(tmp_path, "meld")
    ckpt = save_tiny(tmp_path / "ckpt", "bert", seed=3)
    clash = run_cli("drop", ckpt, "--run", "r1", "--name", "meld", "--dataset", "goemotions", "--store", root)
    assert clash.returncode == 2 and clash.stderr.strip() == (
        "error: --name meld: it replaces run r1's model of dataset meld, but --dataset is goemotions — give another "
        "--name for a model of goemotions"
    ), clash.stderr
    for name in ("meld-v1", "meld-v2"):  # models of meld besides the run's own (a soup of fine-tunes)
        res = run_cli("drop", ckpt, "--run", "r1", "--dataset", "meld", "--name", name, "--store", root)
        assert res.returncode == 0, res.stderr
    assert store.folders(layout.incoming_prefix("r1")) == ["meld-v1", "meld-v2"]


def test_the_re_merge_evaluates_a_new_model_on_its_dataset_as_the_run_does(tmp_path):
    from flows.watch import with_checkpoints
    from symfuse.config import RunConfig

    store = ArtifactStore(str(tmp_path / "store"))
    config = RunConfig(run_id="r1", store_root=str(tmp_path / "store"),
                       datasets=[{"name": "meld"}, {"name": "isear", "source": str(tmp_path / "data"),
                                                    "max_eval_examples": 50}])  # fmt: skip
    ckpt = save_tiny(tmp_path / "ckpt", "bert", seed=3)
    dropped = (("isear-v2", "isear"), ("extra", "goemotions"), ("meld", "meld"), ("isear", "meld"))
    put = {n: store.put_dir(layout.incoming_key("r1", n), ckpt, "test", meta={"dataset": d}) for n, d in dropped}
    warnings = []
    got = with_checkpoints(config, store, list(put.values()), lambda msg, *a: warnings.append(msg % a))
    by_name = {d.name: d for d in got.datasets}
    assert list(by_name) == ["meld", "isear", "extra", "isear-v2"]
    # it was evaluated on a bare name "isear" (not the run's isear folder), with none of its settings
    assert by_name["isear-v2"].source == str(tmp_path / "data") and by_name["isear-v2"].max_eval_examples == 50
    assert by_name["isear-v2"].checkpoint == put["isear-v2"] and by_name["extra"].source == "goemotions"
    assert by_name["meld"].checkpoint == put["meld"] and by_name["isear"].checkpoint is None
    (line,) = warnings
    assert line.startswith(f"{put['isear']}: named as the run's model isear but dropped for dataset meld — left out")
