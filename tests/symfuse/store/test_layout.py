"""Artifact keys and content keys."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from symfuse.arch import ModuleRef
from symfuse.store import layout


def test_every_key_has_its_documented_shape():
    assert layout.model_key("r", "isear") == "runs/r/models/isear"
    assert layout.incoming_key("r", "ckpt-7") == "runs/r/incoming/ckpt-7"
    assert layout.stats_key("r", "isear", "meld", "gram") == "runs/r/stats/isear/meld/gram"
    assert layout.transform_key("r", "isear", "L03.attn") == "runs/r/transforms/isear/L03.attn"
    assert layout.matched_key("r", "isear") == "runs/r/matched/isear"
    assert layout.merged_key("r", "regmean", "matched") == "runs/r/merged/regmean/matched"
    assert layout.merged_name("regmean", "plain") == "regmean-plain"
    assert layout.eval_key("r", "regmean-plain", "goemotions_ekman") == "runs/r/eval/regmean-plain/goemotions_ekman"
    assert layout.report_key("r") == "runs/r/report"
    assert layout.published_key("r") == "runs/r/published"
    assert layout.models_prefix("r") == "runs/r/models"
    assert layout.merged_prefix("r") == "runs/r/merged"
    assert layout.matched_prefix("r") == "runs/r/matched"
    assert layout.eval_prefix("r") == "runs/r/eval"
    assert layout.incoming_prefix("r") == "runs/r/incoming"
    # every key of a run lies under its prefix, and prefixes hold their keys
    assert layout.merged_key("r", "simple", "plain").startswith(layout.merged_prefix("r") + "/")
    assert layout.eval_key("r", "m", "d").startswith(layout.eval_prefix("r") + "/")


def test_transform_key_takes_a_module_ref():
    ref = ModuleRef(3, "ffn")
    assert layout.transform_key("r", "m", ref) == f"runs/r/transforms/m/{ref.key}"


@pytest.mark.parametrize("bad", ["", "a/b", "..", ".hidden", "x y", "é"])
def test_bad_segments_are_refused(bad):
    with pytest.raises(ValueError, match="artifact key"):
        layout.model_key("r", bad)


def test_bad_variant_is_refused():
    with pytest.raises(ValueError, match="plain"):
        layout.merged_key("r", "simple", "both")


class Cfg(BaseModel):
    lr: float
    epochs: int


MAN_A = {"files": ["w"], "sizes": {"w": 1}, "sha256": {"w": "aa"}, "producer": "p", "created": "t1", "inputs": {}}


def test_content_key_depends_on_content_and_config_only():
    key = layout.content_key(Cfg(lr=1e-4, epochs=1), {"model": MAN_A, "data": "dair_emotion"})
    assert len(key) == 16 and int(key, 16) >= 0
    # same bytes written by someone else at another time: same key; dict form of the config: same key
    other = {**MAN_A, "producer": "q", "created": "t2"}
    assert layout.content_key({"epochs": 1, "lr": 1e-4}, {"data": "dair_emotion", "model": other}) == key
    # any change of config, input bytes or input string changes it
    assert layout.content_key(Cfg(lr=1e-4, epochs=2), {"model": MAN_A, "data": "dair_emotion"}) != key
    changed = {**MAN_A, "sha256": {"w": "bb"}}
    assert layout.content_key(Cfg(lr=1e-4, epochs=1), {"model": changed, "data": "dair_emotion"}) != key
    assert layout.content_key(Cfg(lr=1e-4, epochs=1), {"model": MAN_A, "data": "isear"}) != key
    assert layout.content_key(None, {}) == layout.content_key({}, {})
