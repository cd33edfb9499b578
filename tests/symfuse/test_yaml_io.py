"""The one YAML loader for files people write: safe, and a mapping key given twice is an error with its line."""

from __future__ import annotations

import pytest
import yaml

from symfuse.arch import registry
from symfuse.yaml_io import DuplicateKeyError, load


@pytest.mark.parametrize("fast", [False, True])
def test_a_key_given_twice_names_both_lines(fast):
    with pytest.raises(DuplicateKeyError) as info:
        load("strategy: simple\nmodels: [a, b]\nstrategy: ties\n", fast=fast)
    assert str(info.value) == "line 3: key 'strategy' given twice (first at line 1) — keep one"
    with pytest.raises(DuplicateKeyError, match="line 2: key 'x' given twice"):
        load("a:\n  {x: 1, y: 2, x: 3}\n", fast=fast)  # nested, in flow style


@pytest.mark.parametrize("fast", [False, True])
def test_distinct_keys_merge_keys_and_plain_documents_still_load(fast):
    assert load("a: 1\nb: {a: 2}\n", fast=fast) == {"a": 1, "b": {"a": 2}}  # one key at two levels is fine
    text = "base: &b {lr: 0.1, epochs: 2}\nrun:\n  <<: *b\n  lr: 0.2\n"  # a merge key's values may be overridden
    assert load(text, fast=fast)["run"] == {"lr": 0.2, "epochs": 2}
    assert load("", fast=fast) is None and load("- 1\n- 2\n", fast=fast) == [1, 2]


@pytest.mark.parametrize("fast", [False, True])
def test_it_stays_safe(fast):
    with pytest.raises(yaml.YAMLError):
        load("!!python/object/apply:os.system ['true']\n", fast=fast)


def test_a_family_file_with_a_key_given_twice_is_refused(tmp_path, monkeypatch):
    text = (registry._FAMILIES / "bert.yaml").read_text()
    (tmp_path / "bert.yaml").write_text(text + "family: bert\n")
    monkeypatch.setattr(registry, "_FAMILIES", tmp_path)
    registry.all_specs.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"^bert\.yaml: line \d+: key 'family' given twice \(first at line \d+\)"):
            registry.all_specs()
    finally:
        registry.all_specs.cache_clear()
