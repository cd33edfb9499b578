"""Every command that computes takes --device; a device that is not there is one line, exit 2, nothing written."""

import pytest
import torch

from tests.cli.helpers import listing, run_cli, toy_dataset
from tests.tiny import save_tiny, save_tiny_text_classifier

pytestmark = pytest.mark.skipif(torch.cuda.device_count() > 7, reason="needs a machine without cuda:7")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("device")
    save_tiny_text_classifier(root / "a", seed=1)
    save_tiny_text_classifier(root / "b", seed=2)
    save_tiny(root / "l", "llama", seed=1)
    save_tiny(root / "l2", "llama", seed=2)
    toy_dataset(root / "data")
    (root / "adapter").mkdir()
    (root / "adapter" / "adapter_config.json").write_text("{}")  # refused on --device before it is read
    return root


COMMANDS = {
    "match": "match {l} {l} --out {o}",
    "match-many": "match-many {l} {l2} --out {o}",
    "disguise": "disguise {l} --out {o}",
    "stats": "stats {a} --data {data} --kind gram --out {o}",
    "merge": "merge --strategy simple --models {a} {b} --out {o}",
    "finetune": "finetune {a} --data {data} --out {o} --epochs 1",
    "evaluate": "evaluate {a} --data {data}",
    "barrier": "barrier {a} {b} --data {data} --out {o}",
    "inspect": "inspect {a} {b} --data {data} --out {o}.png",
    "merge-lora": "merge-lora --adapters {ad} --out {o}",
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_missing_device_is_refused_before_any_work(inputs, command):
    paths = {name: inputs / name for name in ("a", "b", "l", "l2", "data")}
    args = COMMANDS[command].format(**paths, ad=inputs / "adapter", o=inputs / f"out-{command}").split()
    before = listing(inputs)
    proc = run_cli(*args, "--device", "cuda:7")
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --device: 'cuda:7' asked for, but ") and "Traceback" not in proc.stderr
    assert listing(inputs) == before  # nothing written


def test_an_unknown_device_name_lists_the_choices(inputs):
    proc = run_cli("merge", "--strategy", "simple", "--models", inputs / "a", inputs / "b", "--out", inputs / "x",
                   "--device", "gpu")  # fmt: skip
    assert proc.returncode == 2
    assert "is not a device symfuse runs on — give auto, cpu, cuda or cuda:N" in proc.stderr
