"""The demo's datasets travel with the package: they resolve on a clone without ../shared, carry their sources and
licences, keep the held-out set out of every training subset, and bare names resolve in the documented order."""

from __future__ import annotations

import fnmatch
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from symfuse.config import DATASET_RESOLUTION, DEMO_DATASETS, DEMO_OUT_OF_DOMAIN, DEMO_QUICK_DATASETS, RunConfig
from symfuse.data import DatasetError, bundled_datasets, load_task_dataset
from symfuse.data.locate import BUNDLED_DIR, shared_location

ROOT = Path(__file__).resolve().parents[3]
DEMO = [*DEMO_DATASETS, *DEMO_OUT_OF_DOMAIN]


@pytest.fixture
def no_shared(monkeypatch, tmp_path):
    """A clone with no ../shared next to it and no $SYMFUSE_DATASETS (also not via the working directory)."""
    monkeypatch.delenv("SYMFUSE_DATASETS", raising=False)
    monkeypatch.setenv("SYMFUSE_SHARED_DATASETS", "")
    monkeypatch.chdir(tmp_path)
    assert shared_location() is None


def _texts(name: str, splits=("train", "validation", "test")) -> set[str]:
    out = set()
    for split in splits:
        for line in (BUNDLED_DIR / name / f"{split}.jsonl").read_text(encoding="utf-8").splitlines():
            out.add(" ".join(json.loads(line)["text"].lower().split()))
    return out


def test_every_demo_dataset_resolves_to_the_bundled_subset_without_shared(no_shared):
    quick, full = RunConfig.demo(quick=True), RunConfig.demo()
    assert full.dataset_names == list(DEMO_DATASETS)
    assert quick.dataset_names == list(DEMO_QUICK_DATASETS) and set(DEMO_QUICK_DATASETS) < set(DEMO_DATASETS)
    assert quick.evaluation.out_of_domain == full.evaluation.out_of_domain == list(DEMO_OUT_OF_DOMAIN)
    assert set(DEMO) <= set(bundled_datasets())
    for d in full.datasets:
        ds = load_task_dataset(d.data, max_train_examples=d.max_train_examples, max_eval_examples=d.max_eval_examples)
        assert all(f.parent == BUNDLED_DIR / d.name for f in ds.files.values()), ds.files
        # bundled at the full demo's caps: the full demo reads every bundled row, the quick one a seeded subset
        assert {s: len(x) for s, x in ds.splits.items()} == {"train": 2000, "validation": 500, "test": 500}
        meta = json.loads((BUNDLED_DIR / d.name / "meta.json").read_text())
        assert ds.labels == meta["labels"] and len(ds.labels) >= 7
    q = quick.datasets[0]
    small = load_task_dataset(q.data, max_train_examples=q.max_train_examples, max_eval_examples=q.max_eval_examples)
    assert {s: len(x) for s, x in small.splits.items()} == {"train": 300, "validation": 100, "test": 100}
    ood = load_task_dataset(DEMO_OUT_OF_DOMAIN[0])
    assert ood.files["test"].parent == BUNDLED_DIR / DEMO_OUT_OF_DOMAIN[0] and len(ood.splits["test"]) == 500
    # the held-out labels overlap every training set's (in-domain / out-of-domain story)
    for name in DEMO_DATASETS:
        assert len(set(ood.labels) & set(load_task_dataset(name).labels)) >= 4, name


def test_bundled_sets_carry_source_and_licence_and_ship_in_the_wheel():
    notes = (BUNDLED_DIR / "SOURCES.md").read_text()
    licences = {"GPL-3.0": "GPL-3.0.txt", "Apache-2.0": "Apache-2.0.txt"}
    for name in bundled_datasets():
        meta = json.loads((BUNDLED_DIR / name / "meta.json").read_text())
        commit = meta["source"]["commit"]
        assert re.fullmatch(r"[0-9a-f]{40}", commit) and meta["source"]["repo"].startswith("https://github.com/")
        assert meta["licence"] and meta["subset"]["made_by"] == "scripts/make_demo_data.py"
        row = next(ln for ln in notes.splitlines() if ln.startswith(f"| {name} |"))
        assert commit in row and meta["licence"].split()[0] in row, row
        for spdx, file in licences.items():
            if meta["licence"].startswith(spdx):
                assert (BUNDLED_DIR / "LICENSES" / file).stat().st_size > 5000
    assert "research-only" in notes and "dair_emotion" in notes  # why the old defaults were swapped
    files = [p for p in BUNDLED_DIR.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) < 2_000_000
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["symfuse"]
    package = ROOT / "src" / "symfuse"
    for p in files:  # a non-editable install carries every bundled file
        rel = p.relative_to(package).as_posix()
        assert any(fnmatch.fnmatch(rel, pat) for pat in patterns), rel


def test_held_out_texts_are_in_no_training_subset():
    seen = set().union(*(_texts(n) for n in DEMO_DATASETS))
    for name in DEMO_OUT_OF_DOMAIN:
        held_out = _texts(name)
        assert len(held_out) > 1000
        assert not held_out & seen, sorted(held_out & seen)[:3]
    # goemotions and goemotions_ekman come from the same Reddit comments: the check above is not vacuous
    shared_root = shared_location()
    if shared_root is not None and (shared_root / "goemotions_ekman").is_dir():
        full = {
            " ".join(json.loads(line)["text"].lower().split())
            for line in (shared_root / "goemotions_ekman" / "train.jsonl").read_text(encoding="utf-8").splitlines()
        }
        assert len(full & _texts("goemotions", ("train",))) > 1500


def test_bare_name_resolution_order(tmp_path, monkeypatch):
    def folder(root: Path, label: str) -> Path:
        d = root / "meld"
        d.mkdir(parents=True)
        (d / "train.jsonl").write_text(json.dumps({"text": "x", "label": label}) + "\n")
        return d

    env, shared, explicit = folder(tmp_path / "env", "a"), folder(tmp_path / "shared", "b"), folder(tmp_path, "c")
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")  # no ./meld here
    monkeypatch.setenv("SYMFUSE_DATASETS", str(tmp_path / "env"))
    monkeypatch.setenv("SYMFUSE_SHARED_DATASETS", str(tmp_path / "shared"))
    assert load_task_dataset(str(explicit)).files["train"].parent == explicit  # explicit path first
    assert load_task_dataset("meld").files["train"].parent == env  # then $SYMFUSE_DATASETS
    monkeypatch.setenv("SYMFUSE_DATASETS", str(tmp_path / "empty"))  # set, but without meld: falls through
    assert load_task_dataset("meld").files["train"].parent == shared  # then ../shared/datasets
    monkeypatch.delenv("SYMFUSE_DATASETS")
    monkeypatch.setenv("SYMFUSE_SHARED_DATASETS", "")
    assert load_task_dataset("meld").files["train"].parent == BUNDLED_DIR / "meld"  # then the bundled subset


def test_offline_name_found_nowhere_is_one_line_naming_what_to_provide(no_shared):
    with pytest.raises(DatasetError) as info:
        load_task_dataset("dair_emotion")
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("dair_emotion: no dataset of that name")
    for part in ("$SYMFUSE_DATASETS", "../shared/datasets", "bundled demo data (crowdflower", "hf:dair_emotion"):
        assert part in msg, part
    assert "LICENSES" not in msg  # the licence folder is no dataset
    with pytest.raises(DatasetError, match=r"did you mean meld\?"):
        load_task_dataset("meldd")
    with pytest.raises(DatasetError, match="LICENSES: no dataset of that name"):
        load_task_dataset("LICENSES")


def test_help_documents_the_resolution_order(capsys):
    from typer.testing import CliRunner

    from flows.cli import parse_args
    from symfuse.cli import app, commands  # noqa: F401  (importing commands registers them on app)

    assert ", ".join(bundled_datasets()) in DATASET_RESOLUTION
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "$SYMFUSE_DATASETS, then ../shared/datasets" in text and "bundled" in text and "hf:<id>" in text
    for cmd in ("finetune", "stats", "evaluate", "barrier", "match"):
        out = CliRunner().invoke(app, [cmd, "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"}).output
        assert "SYMFUSE_DATASETS" in out and "bundled" in out, cmd


@pytest.mark.skipif(shared_location() is None, reason="needs ../shared/datasets to rebuild from")
def test_make_demo_data_rebuilds_the_bundled_files_byte_for_byte(tmp_path):
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_demo_data.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    for p in tmp_path.rglob("*.json*"):
        assert p.read_bytes() == (BUNDLED_DIR / p.relative_to(tmp_path)).read_bytes(), p
    assert len(list(tmp_path.rglob("*.jsonl"))) == 3 * len(DEMO)
