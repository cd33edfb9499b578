"""A dataset whose task the model's head cannot score is one line before any forward pass (it was an internal error)."""

from __future__ import annotations

import json

import pytest

from tests.cli.helpers import run_cli
from tests.tiny import save_tiny_text_classifier


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("head-task")
    regress = root / "regress"
    regress.mkdir()
    rows = [{"text": f"a sentence {i}", "text_pair": f"another {i}", "label": i / 8} for i in range(8)]
    for split in ("train", "validation", "test"):
        (regress / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (regress / "meta.json").write_text('{"task": "regression"}')
    return {"A": save_tiny_text_classifier(root / "a", seed=1), "B": save_tiny_text_classifier(root / "b", seed=2),
            "REG": regress, "OUT": root / "out"}  # fmt: skip


@pytest.mark.parametrize(
    "args",
    [
        ["evaluate", "{A}", "--data", "{REG}", "--out", "{OUT}/e.json"],
        ["stats", "{A}", "--data", "{REG}", "--kind", "fisher", "--out", "{OUT}/s"],
        ["barrier", "{A}", "{B}", "--data", "{REG}", "--points", "3", "--out", "{OUT}/b"],
        ["inspect", "{A}", "{B}", "--data", "{REG}", "--residual-iters", "0"],
        [
            "match",
            "{A}",
            "{B}",
            "--symmetries",
            "residual-orthogonal",
            "--refine",
            "3",
            "--data",
            "{REG}",
            "--out",
            "{OUT}/m",
        ],
    ],
    ids=["evaluate", "stats-fisher", "barrier", "inspect", "match-refine"],
)
def test_a_regression_set_on_a_classifier_is_refused_in_one_line(args, inputs):
    res = run_cli(*[a.format(**inputs) for a in args])
    assert res.returncode == 2, res.stderr
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]  # after the dataset's INFO line
    assert "Traceback" not in res.stderr and errors == [
        f"error: --data {inputs['REG']}: a regression dataset, and {inputs['A']} has a sequence-classification head "
        "— give a dataset of its task, or a model fine-tuned on it"
    ], res.stderr
    assert not inputs["OUT"].exists()
