"""``symfuse merge-lora``: a merge that PEFT loads, exit codes and one-line errors; ``symfuse merge`` points to it."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
from typer.testing import CliRunner

from symfuse.cli import app
from symfuse.cli import commands as _commands  # noqa: F401  (registers the commands)
from symfuse.lora import read_adapter
from tests.symfuse.lora.helpers import make_adapter, tiny_base

runner = CliRunner()


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora-cli")
    base = tiny_base(d / "base")
    return {"base": base, "a1": make_adapter(base, d / "a1", seed=1), "a2": make_adapter(base, d / "a2", seed=2)}


def _run(*args):
    return runner.invoke(app, ["merge-lora", *map(str, args)], terminal_width=200)


def test_merge_lora_writes_an_adapter_and_a_report(zoo, tmp_path):
    out = tmp_path / "out"
    res = _run("--adapters", zoo["a1"], zoo["a2"], "--strategy", "ties", "--density", "0.5", "--weights", 1, 2,
               "--basis", "aligned", "--out", out)  # fmt: skip
    assert res.exit_code == 0, res.output
    assert str(out) in res.output and "aligned basis" in res.output
    report = json.loads((out / "symfuse_report.json").read_text())
    assert report["strategy"] == "ties" and report["params"]["density"] == 0.5
    assert report["weights"] == pytest.approx([1 / 3, 2 / 3]) and report["rank"] == 8
    assert set(read_adapter(out).modules) == set(read_adapter(zoo["a1"]).modules)


def test_merge_lora_into_base_writes_a_checkpoint(zoo, tmp_path):
    res = _run("--adapters", zoo["a1"], "--base", zoo["base"], "--into-base", "--out", tmp_path / "m")
    assert res.exit_code == 0, res.output
    assert (tmp_path / "m" / "config.json").is_file() and (tmp_path / "m" / "model.safetensors").is_file()


def _refused(res, code: int, text: str) -> None:
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert res.exit_code == code, res.output
    assert lines[-1].startswith("error: ") and text in lines[-1], res.output
    assert "Traceback" not in res.output


def test_merge_lora_refusals(zoo, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(zoo["a2"], other)
    cfg = json.loads((other / "adapter_config.json").read_text())
    (other / "adapter_config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": "/elsewhere"}))
    bias = tmp_path / "bias"
    shutil.copytree(zoo["a2"], bias)
    (bias / "adapter_config.json").write_text(json.dumps({**cfg, "lora_bias": True}))
    out = tmp_path / "out"
    _refused(_run("--adapters", zoo["base"], "--out", out), 2, "not a PEFT adapter folder")
    _refused(_run("--adapters", zoo["a1"], other, "--out", out), 1, "merge adapters of one base")
    _refused(_run("--adapters", zoo["a1"], bias, "--out", out), 1, "lora_bias is set")
    _refused(_run("--adapters", zoo["a1"], "--basis", "wrong", "--out", out), 2, "--basis: unknown value")
    _refused(_run("--adapters", zoo["a1"], "--into-base", "--out", out), 2, "--into-base: no --base")
    _refused(_run("--adapters", zoo["a1"], zoo["a2"], "--weights", 1, "--out", out), 2, "1 weight(s) for 2")
    _refused(_run("--adapters", zoo["a1"], "--strategy", "ties", "--density", 2, "--out", out), 2, "--density")
    assert not out.exists()


def test_a_rank_that_disagrees_with_the_config_is_refused(zoo, tmp_path):
    """PEFT sizes lora_A / lora_B from r (or rank_pattern) and cannot load tensors of another rank."""
    cfg = json.loads((zoo["a2"] / "adapter_config.json").read_text())
    wrong_r, wrong_pattern = tmp_path / "wrong_r", tmp_path / "wrong_pattern"
    for folder, change in ((wrong_r, {"r": 16}), (wrong_pattern, {"rank_pattern": {"v_proj": 2}})):
        shutil.copytree(zoo["a2"], folder)
        (folder / "adapter_config.json").write_text(json.dumps({**cfg, **change}))
    out = tmp_path / "out"
    fix = "fix r in adapter_config.json or re-save the adapter with PEFT"
    _refused(_run("--adapters", wrong_r, zoo["a1"], "--out", out), 1,
             f"{wrong_r}: base_model.model.model.layers.0.mlp.down_proj.lora_A.weight has rank 4 but "
             f"adapter_config.json says r = 16 — {fix}")  # fmt: skip
    _refused(_run("--adapters", zoo["a1"], wrong_pattern, "--out", out), 1,
             f"{wrong_pattern}: base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight has rank 4 but "
             "adapter_config.json says r = 2 (rank_pattern 'v_proj') — fix rank_pattern")  # fmt: skip
    assert not out.exists()
    patterned = make_adapter(zoo["base"], tmp_path / "patterned", seed=3, rank_pattern={"q_proj": 2})  # PEFT's own
    assert {m.rank for k, m in read_adapter(patterned).modules.items() if k.endswith("q_proj")} == {2}
    assert _run("--adapters", patterned, zoo["a1"], "--out", out).exit_code == 0


def _set_base(adapter, name) -> None:
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": str(name)}))


def _adapters_of(zoo, folder, name):
    """Copies of a1 and a2 in ``folder`` whose adapter_config.json names the base ``name``."""
    copies = []
    for key in ("a1", "a2"):
        shutil.copytree(zoo[key], folder / key)
        _set_base(folder / key, name)
        copies.append(folder / key)
    return copies


def test_into_base_refuses_a_base_other_than_the_local_folder_the_adapters_name(zoo, tmp_path):
    """Same shapes, another folder: folding into it would be silently wrong; naming the moved base fixes it."""
    other = tmp_path / "other-base"
    shutil.copytree(zoo["base"], other)
    out = tmp_path / "out"
    res = _run("--adapters", zoo["a1"], zoo["a2"], "--strategy", "simple", "--into-base", "--base", other,
               "--out", out)  # fmt: skip
    _refused(res, 1, f"{zoo['a1']}: adapter of base {zoo['base'].resolve()}, but --base is {other.resolve()} — "
                     f"pass --base {zoo['base']}, or edit base_model_name_or_path")  # fmt: skip
    assert not out.exists()
    a1, a2 = _adapters_of(zoo, tmp_path / "moved", other)  # the fix: the adapters name the copy
    res = _run("--adapters", a1, a2, "--strategy", "simple", "--into-base", "--base", other, "--out", out)
    assert res.exit_code == 0, res.output
    assert (out / "model.safetensors").is_file()


def test_a_hub_base_is_matched_by_name_and_only_warned_about(zoo, tmp_path, caplog):
    """A hub id is compared by its last component with --base's folder name or config.json _name_or_path."""
    renamed = tmp_path / "renamed"
    shutil.copytree(zoo["base"], renamed)
    cfg = json.loads((renamed / "config.json").read_text())
    (renamed / "config.json").write_text(json.dumps({**cfg, "_name_or_path": "org/tiny-llama"}))
    cases = [("org/base", zoo["base"], False), ("org/tiny-llama", renamed, False), ("org/other-model", renamed, True)]
    for i, (hub_id, base, warned) in enumerate(cases):
        a1, a2 = _adapters_of(zoo, tmp_path / f"hub{i}", hub_id)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="symfuse.lora.merge"):
            res = _run("--adapters", a1, a2, "--strategy", "simple", "--into-base", "--base", base,
                       "--out", tmp_path / f"out{i}")  # fmt: skip
        assert res.exit_code == 0, res.output
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == int(warned), (hub_id, warnings)
        if warned:
            assert f"adapter of base {hub_id}, but --base {base.resolve()}" in warnings[0], warnings


def test_merge_points_adapter_folders_to_merge_lora(zoo, tmp_path):
    res = runner.invoke(app, ["merge", "--strategy", "simple", "--models", str(zoo["a1"]), str(zoo["a2"]),
                              "--out", str(tmp_path / "out")], terminal_width=200)  # fmt: skip
    _refused(res, 2, "symfuse merge-lora")


def test_the_readme_lora_commands_run_as_written(zoo, tmp_path, monkeypatch):
    """The README's LoRA adapters block, run in a folder holding lora/a, lora/b and lora/base."""
    import re
    import shlex

    from tests.cli.helpers import ROOT

    section = (ROOT / "README.md").read_text().split("## LoRA adapters", 1)[1].split("\n## ", 1)[0]
    lines = re.search(r"```bash\n(.*?)```", section, flags=re.S).group(1).strip().splitlines()
    assert len(lines) == 2
    for name in ("a", "b", "base"):
        shutil.copytree(zoo[{"a": "a1", "b": "a2"}.get(name, name)], tmp_path / "lora" / name)
    for name in ("a", "b"):  # adapters trained on lora/base (the copies still name the fixture's base)
        _set_base(tmp_path / "lora" / name, "lora/base")
    monkeypatch.chdir(tmp_path)
    for line in lines:
        args = shlex.split(line.removeprefix(".venv/bin/symfuse "))
        res = runner.invoke(app, args, terminal_width=200)
        assert res.exit_code == 0, (line, res.output)
    assert (tmp_path / "lora/merged/adapter_model.safetensors").is_file()
    assert (tmp_path / "lora/merged-model/model.safetensors").is_file()
