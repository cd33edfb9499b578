"""mergekit's YAML read as it is by ``symfuse merge --config``: translations, the merge itself, the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

import symfuse.cli.commands  # noqa: F401  (registers the commands)
from symfuse.cli import app
from symfuse.errors import UsageError
from symfuse.merge_config import MergeFile, load_merge_file
from tests.cli.helpers import listing, run_cli

ROOT = Path(__file__).resolve().parents[2]


def write(folder: Path, doc: dict | str, name: str = "mk.yml") -> Path:
    path = folder / name
    path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc, sort_keys=False))
    return path


def two(a: dict | None = None, b: dict | None = None, **top) -> dict:
    """A mergekit document over models a and b (per-model parameters a, b) and base ``base``."""
    models = [{"model": "a", **({"parameters": a} if a else {})}, {"model": "b", **({"parameters": b} if b else {})}]
    return {"models": models, "base_model": "base", **top}


def expected(strategy: str, params: dict, weights=None, base="base", out_dtype=None) -> MergeFile:
    fields = {"strategy": strategy, "models": ["a", "b"], "params": params, "base": base, "weights": weights}
    fields |= {"out_dtype": out_dtype}
    return MergeFile.model_validate({k: v for k, v in fields.items() if v is not None})


README_TIES = """
models:
  - model: a
    parameters:
      density: 0.5
      weight: 1.0
  - model: b
    parameters:
      density: 0.5
      weight: 0.5
merge_method: ties
base_model: base
parameters:
  normalize: true
  int8_mask: true
dtype: float16
"""


@pytest.mark.parametrize(
    ("doc", "want"),
    [
        (README_TIES, expected("ties", {"density": 0.5, "lam": 1.0}, [1.0, 0.5], out_dtype="float16")),
        # mergekit's ties keeps everything by default (density 1.0): written out, as symfuse's default is 0.2
        (two(merge_method="ties"), expected("ties", {"density": 1.0, "lam": 1.0})),
        (
            two({"weight": 0.7}, {"weight": 0.3}, merge_method="linear", base_model=None),
            expected("simple", {}, [0.7, 0.3], base=None),
        ),
        (
            two(merge_method="linear", base_model=None, parameters={"normalize": True}),
            expected("simple", {}, base=None),
        ),
        # linear lists its own models; a base_model that is one of them is merged as one of them
        (
            {"models": [{"model": "a"}, {"model": "b"}], "base_model": "a", "merge_method": "linear"},
            expected("simple", {}, base=None),
        ),
        # base + lambda * (1.0 tau_a + 0.5 tau_b) = base + lam * K * (w_i / sum w) tau_i with lam = 0.8 * 1.5 / 2
        (
            two({"weight": 1.0}, {"weight": 0.5}, merge_method="task_arithmetic", parameters={"lambda": 0.8}),
            expected("task-arithmetic", {"lam": 0.8 * 1.5 / 2}, [1.0, 0.5]),
        ),
        (two(merge_method="task_arithmetic"), expected("task-arithmetic", {"lam": 1.0})),
        (
            two(merge_method="task_arithmetic", parameters={"normalize": True, "lambda": 2.0}),
            expected("task-arithmetic", {"lam": 1.0}),
        ),
        (
            two(
                {"density": 0.53, "weight": 0.4},
                {"density": 0.53, "weight": 0.6},
                merge_method="dare_ties",
                parameters={"normalize": True, "int8_mask": True, "lambda": 1.1},
            ),
            expected("dare", {"drop": 1 - 0.53, "combine": "ties", "lam": 1.1}, [0.4, 0.6]),
        ),
        (
            two(merge_method="dare_linear", parameters={"density": 0.3, "weight": 0.5}),
            expected("dare", {"drop": 0.7, "combine": "task-arithmetic", "lam": 0.5}, [0.5, 0.5]),
        ),
        # mergekit skips the base among the models of a task-vector method
        (
            {"models": ["base", "a", "b"], "base_model": "base", "merge_method": "ties",
             "parameters": {"density": 0.4}},
            expected("ties", {"density": 0.4, "lam": 1.0}),
        ),
    ],
    ids=["readme-ties", "ties-defaults", "linear", "linear-uniform", "linear-base-listed", "task-arithmetic",
         "task-arithmetic-defaults", "task-arithmetic-normalize", "dare-ties", "dare-linear", "ties-base-listed"],
)  # fmt: skip
def test_mergekit_yaml_reads_as_the_symfuse_merge_file(tmp_path, doc, want):
    got = load_merge_file(write(tmp_path, doc))
    assert got.model_dump() == want.model_dump()


def test_parameters_are_named_by_their_mergekit_key(tmp_path):
    got = load_merge_file(write(tmp_path, README_TIES))
    assert got.key_of("density") == "models[0].parameters.density"
    assert got.key_of("lam") == "parameters.lambda"
    dare = load_merge_file(write(tmp_path, two(merge_method="dare_linear", parameters={"density": 0.3})))
    assert dare.key_of("drop") == "parameters.density"
    native = load_merge_file(write(tmp_path, {"strategy": "ties", "models": ["a", "b"], "base": "base"}))
    assert native.key_of("density") == "params.density"


def test_the_example_file_is_the_readme_ties_merge():
    got = load_merge_file(ROOT / "examples" / "mergekit.yml")
    assert (got.strategy, got.models, got.base) == ("ties", ["ft/crowdflower", "ft/meld"], "minilm")
    assert (got.weights, got.params) == ([1.0, 0.5], {"density": 0.5, "lam": 1.0})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """Two tiny fine-tunes ``a``, ``b`` and their ``base`` (tiny BERT classifiers)."""
    from tests.tiny import save_tiny_text_classifier

    folder = tmp_path_factory.mktemp("mk")
    for seed, name in enumerate(["base", "a", "b"]):
        save_tiny_text_classifier(folder / name, seed=seed)
    return folder


def test_slices_covering_whole_models_read_as_models(tiny):
    layers = json.loads((tiny / "a" / "config.json").read_text())["num_hidden_layers"]
    sources = [{"model": str(tiny / m), "layer_range": [0, layers]} for m in ("a", "b")]
    doc = {"slices": [{"sources": sources}], "merge_method": "ties", "base_model": str(tiny / "base")}
    got = load_merge_file(write(tiny, doc, "slices.yml"))
    assert got.models == [str(tiny / "a"), str(tiny / "b")]


def test_a_mergekit_ties_merge_equals_the_same_merge_from_flags(tiny, tmp_path):
    """The translated file and `--strategy ties` with the same flags write the same tensors, bit for bit."""
    from safetensors.torch import load_file

    a, b, base = (str(tiny / m) for m in ("a", "b", "base"))
    doc = {
        "models": [
            {"model": a, "parameters": {"density": 0.5, "weight": 1.0}},
            {"model": b, "parameters": {"density": 0.5, "weight": 0.5}},
        ],
        "merge_method": "ties",
        "base_model": base,
        "parameters": {"normalize": True, "int8_mask": True, "lambda": 0.9},
        "dtype": "float32",
    }
    r = run_cli("merge", "--config", write(tmp_path, doc), tmp_path / "from-yaml", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert "dtype: float32: merged in float32 or wider, written in float32" in r.stderr
    flags = ["--strategy", "ties", "--base", base, "--models", a, b, "--weights", "1.0", "0.5"]
    r = run_cli(
        "merge", *flags, "--density", "0.5", "--lam", "0.9", "--out", tmp_path / "from-flags", "--device", "cpu"
    )
    assert r.returncode == 0, r.stderr
    got, want = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("from-yaml", "from-flags"))
    assert got.keys() == want.keys()
    assert all(got[k].dtype == want[k].dtype and got[k].equal(want[k]) for k in want)
    assert any(not got[k].equal(load_file(str(tiny / "a" / "model.safetensors"))[k]) for k in got)  # it merged


def test_mergekit_dtype_is_the_dtype_written_out_dtype_first(tiny, tmp_path):
    """mergekit writes out_dtype, else dtype: so does symfuse (the float32 merge rounded once; config.json says so)."""
    from safetensors.torch import load_file

    a, b = str(tiny / "a"), str(tiny / "b")
    r = run_cli("merge", "--models", a, b, "--strategy", "simple", "--out", tmp_path / "fp32", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    want = load_file(str(tmp_path / "fp32" / "model.safetensors"))
    cases = {"bf16": ({"dtype": "bfloat16"}, torch.bfloat16), "fp16": ({"dtype": "bfloat16", "out_dtype": "float16"},
             torch.float16)}  # fmt: skip
    for name, (keys, dtype) in cases.items():
        doc = {"models": [{"model": a}, {"model": b}], "merge_method": "linear", **keys}
        r = run_cli("merge", "--config", write(tmp_path, doc, f"{name}.yml"), tmp_path / name, "--device", "cpu")
        assert r.returncode == 0, r.stderr
        got = load_file(str(tmp_path / name / "model.safetensors"))
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k].to(dtype)) for k in want)
        assert json.loads((tmp_path / name / "config.json").read_text())["dtype"] == str(dtype).removeprefix("torch.")
    r = run_cli("merge", "--models", a, b, "--strategy", "simple", "--out", tmp_path / "i8", "--out-dtype", "int8")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: --out-dtype: unknown value 'int8'")
    assert not (tmp_path / "i8").exists()


REFUSED = {
    "unknown-method": (two(merge_method="ram"), "merge_method: ram is not in symfuse yet (symfuse has: "),
    "unequal-density": (
        two({"density": 0.5}, {"density": 0.3}, merge_method="ties", parameters={"normalize": True}),
        "models[1].parameters.density: density differs between models — symfuse applies one density to every model",
    ),
    "key-of-the-file": (
        {
            "models": [
                "base",
                {"model": "a", "parameters": {"density": 0.5}},
                {"model": "b", "parameters": {"density": 0.3}},
            ],
            "merge_method": "ties",
            "base_model": "base",
        },
        "models[2].parameters.density: density differs",
    ),
    "model-default-differs": (
        two({"density": 0.5}, merge_method="ties"),
        "models[0].parameters.density: density differs between models",
    ),
    "dare-density-zero": (  # was named as the drop it becomes: "got 1.0"
        two({"density": 0}, {"density": 0}, merge_method="dare_linear"),
        "models[0].parameters.density: 0 is outside (0, 1] — give the fraction of entries kept",
    ),
    "ties-density-above-one": (
        two(merge_method="ties", parameters={"density": 1.5, "normalize": True}),
        "parameters.density: 1.5 is outside (0, 1]",
    ),
    "gradient": (
        two({"density": [1, 0.7, 0.1]}, merge_method="ties"),
        "models[0].parameters.density: per-layer values (gradients / filters) are not supported yet",
    ),
    "filter": (
        two(merge_method="ties", parameters={"lambda": [{"filter": "mlp", "value": 0.5}, {"value": 1.0}]}),
        "parameters.lambda: per-layer values (gradients / filters) are not supported yet",
    ),
    "weight-gradient": (
        two({"weight": [0, 1]}, merge_method="linear", base_model=None),
        "models[0].parameters.weight: per-layer values",
    ),
    "layer-slices": (
        {
            "slices": [{"sources": [{"model": "{A}", "layer_range": [0, 1]}, {"model": "{B}", "layer_range": [0, 1]}]}],
            "merge_method": "ties",
            "base_model": "{BASE}",
        },
        "slices[0].sources[0].layer_range: [0, 1] of",
    ),
    "stacked-slices": (
        {
            "slices": [{"sources": [{"model": "{A}", "layer_range": [0, 1]}]}] * 2,
            "merge_method": "linear",
        },
        "slices: layer slices (passthrough) are not supported yet — merge whole models",
    ),
    "tokenizer-union": (
        two(merge_method="ties", tokenizer_source="union"),
        "tokenizer_source: union (a merged vocabulary) is not supported yet",
    ),
    "tokenizer-second-model": (
        two(merge_method="ties", tokenizer_source="b"),
        "— symfuse writes the first model's tokenizer: list",
    ),
    "tokenizer-base-without-base": (
        two(merge_method="linear", base_model=None, tokenizer_source="base"),
        "tokenizer_source: base, and the file names no base_model — name base_model, or remove tokenizer_source",
    ),
    "tokenizer-config": (two(merge_method="ties", tokenizer={"source": "union"}), "tokenizer: tokenizer settings"),
    "dtype-not-a-float": (two(merge_method="ties", dtype="int8"), "dtype: 'int8' is not a dtype mergekit merges in"),
    "out-dtype-unknown": (two(merge_method="ties", out_dtype="banana"), "out_dtype: 'banana' is not a dtype mergekit"),
    "chat-template": (two(merge_method="ties", chat_template="chatml"), "chat_template: not supported yet"),
    "lora": (
        {"models": [{"model": "a"}, {"model": "b+loras/b"}], "merge_method": "linear"},
        "models[1].model: b+loras/b: LoRA adapters (model+lora) are not supported yet",
    ),
    "ties-unnormalized": (
        two(merge_method="ties", parameters={"normalize": False}),
        "parameters.normalize: false — ties would then sum the agreeing task vectors",
    ),
    "dare-ties-default-normalize": (
        two(merge_method="dare_ties", parameters={"density": 0.5}),
        "parameters.normalize: absent (mergekit's default: false) — dare_ties",
    ),
    "ties-rescale": (two(merge_method="ties", parameters={"rescale": True}), "parameters.rescale: true"),
    "dare-no-rescale": (two(merge_method="dare_linear", parameters={"rescale": False}), "parameters.rescale: false"),
    "linear-unnormalized": (
        two({"weight": 1.0}, {"weight": 2.0}, merge_method="linear", base_model=None, parameters={"normalize": False}),
        "parameters.normalize: false with weights summing to 3",
    ),
    "negative-weight": (
        two({"weight": 1.0}, {"weight": -0.5}, merge_method="task_arithmetic"),
        "models[1].parameters.weight: -0.5 — symfuse merges weights >= 0 (no task negation yet)",
    ),
    "missing-weight": (two({"weight": 1.0}, merge_method="task_arithmetic"), "models[1].parameters.weight: missing"),
    "unknown-parameter": (
        two(merge_method="ties", parameters={"gamma": 0.1}),
        "parameters.gamma: not a parameter of mergekit's ties — remove it",
    ),
    "misspelt-on-one-model": (  # was "densty differs between models — give them the same value"
        two({"weight": 1.0, "densty": 0.5}, {"weight": 1.0}, merge_method="ties"),
        "models[0].parameters.densty: not a parameter of mergekit's ties — remove it",
    ),
    "per-model-lambda": (
        two({"lambda": 0.5}, {"lambda": 0.5}, merge_method="ties"),
        "models[0].parameters.lambda: mergekit reads lambda for the whole merge only",
    ),
    "no-base": (
        two(merge_method="ties", base_model=None),
        "base_model: missing — mergekit's ties works on task vectors",
    ),
    "linear-base": (two(merge_method="linear"), "base_model: linear does not use a base model"),
    # slerp starts at its base_model: another model was told "--base: --strategy slerp does not use a base model"
    "slerp-base-not-a-model": (two(merge_method="slerp", parameters={"t": 0.3}), "base is not one of models: — slerp"),
    # a gradient with a word in it was told gradients are not supported, which they are for slerp
    "gradient-word": (
        two(merge_method="slerp", base_model="a", parameters={"t": [0, "x"]}),
        "parameters.t: 'x' in a gradient is not a number",
    ),
    "modules": (two(merge_method="ties", modules={"text": {}}), "modules: per-module merges are not supported yet"),
    "unknown-key": (two(merge_method="ties", strategy="ties"), "strategy: not a mergekit key symfuse reads"),
    "one-model": ({"models": ["base", "a"], "merge_method": "ties", "base_model": "base"}, "models: 1 model(s)"),
    # checked by symfuse's strategy once torch is loaded, named by the mergekit key
    "bad-density": (
        two({"density": 0.0}, {"density": 0.0}, merge_method="ties", parameters={"normalize": True}),
        "models[0].parameters.density: 0 is outside (0, 1] — give the fraction of entries kept, e.g. 0.5",
    ),
}


def fill(doc, tiny: Path):
    """``doc`` with the model names a, b, base (and {A}, {B}, {BASE}) made paths of the tiny models."""
    if isinstance(doc, dict):  # tokenizer_source: base is mergekit's keyword, not the model named base
        return {k: v if (k, v) == ("tokenizer_source", "base") else fill(v, tiny) for k, v in doc.items()}
    if isinstance(doc, list):
        return [fill(v, tiny) for v in doc]
    names = {"a": "a", "b": "b", "base": "base", "{A}": "a", "{B}": "b", "{BASE}": "base"}
    return str(tiny / names[doc]) if isinstance(doc, str) and doc in names else doc


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_symfuse_cannot_merge_is_refused_in_one_line_naming_the_key(tiny, tmp_path, case):
    doc, message = REFUSED[case]
    config = write(tmp_path, fill(doc, tiny))
    before = listing(tmp_path)
    r = CliRunner().invoke(app, ["merge", "--config", str(config), str(tmp_path / "out"), "--device", "cpu"])
    assert r.exit_code == 2, r.output
    lines = [line for line in r.stderr.splitlines() if not line.startswith("INFO ")]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"error: {config}: "), lines[0]
    assert message in lines[0]
    assert listing(tmp_path) == before  # nothing written


def test_a_refusal_exits_2_from_the_real_command(tmp_path):
    config = write(tmp_path, two(merge_method="ties", tokenizer_source="union"))
    r = run_cli("merge", "--config", config, tmp_path / "out")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"error: {config}: tokenizer_source: union (a merged vocabulary) is not supported yet — remove it (symfuse "
        "writes the first model's tokenizer)"
    ]
    assert not (tmp_path / "out").exists()


def test_translation_errors_are_usage_errors(tmp_path):
    with pytest.raises(UsageError, match=r"ram is not in symfuse yet"):
        load_merge_file(write(tmp_path, two(merge_method="ram", base_model=None)))
    slerp = load_merge_file(write(tmp_path, two(merge_method="slerp", base_model=None, parameters={"t": 0.3})))
    assert slerp.strategy == "slerp" and slerp.params == {"t": 0.3}  # mergekit's methods under their names


def test_reading_a_mergekit_file_imports_no_torch(tmp_path):
    """A bad file fails before torch loads: the translation needs pydantic and yaml only."""
    import subprocess
    import sys

    from tests.cli.helpers import cli_env

    config = write(tmp_path, two(merge_method="ties", parameters={"normalize": False}))
    code = (
        "import sys\nfrom symfuse.merge_config import load_merge_file\ntry:\n    load_merge_file(sys.argv[1])\n"
        "except ValueError:\n    pass\nprint('torch' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", code, config], env=cli_env(), capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "False"
