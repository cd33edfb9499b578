"""``symfuse.inspect``: verdicts on constructed pairs, distances after alignment, agreement with the barrier code."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from symfuse.errors import UsageError
from symfuse.evaluate.barrier import loss_barrier
from symfuse.inspect import inspect_models
from symfuse.inspect.render import format_report, plot_report
from symfuse.inspect.verdict import ALIGN_FIRST, INCOMPATIBLE, SAME_BASIN, pair_verdict
from symfuse.match import disguise_checkpoint
from tests.cli.helpers import toy_dataset
from tests.tiny import save_tiny, save_tiny_text_classifier

KINDS = ["rotation", "scaling", "ffn-permutation", "head-permutation"]


@pytest.fixture(scope="module")
def bert(tmp_path_factory) -> dict[str, Path]:
    """A tiny BERT, its lightly perturbed copy, its disguise, an unrelated one and one of another width."""
    root = tmp_path_factory.mktemp("inspect-bert")
    a = save_tiny(root / "a", "bert", seed=0)
    return {
        "a": a,
        "noisy": disguise_checkpoint(a, root / "noisy", seed=1, noise=0.01, kinds=[]),
        "disguised": disguise_checkpoint(a, root / "disguised", seed=2, kinds=KINDS),
        "wide": save_tiny(root / "wide", "bert", seed=3, hidden_size=48),
        "gpt2": save_tiny(root / "gpt2", "gpt2", seed=0),
    }


def test_a_lightly_perturbed_copy_is_in_the_same_basin(bert):
    r = inspect_models([bert["a"], bert["noisy"]], device="cpu")
    pair = r["pairs"][0]
    assert r["verdict"] == pair["verdict"] == SAME_BASIN, r["reason"]
    assert pair["total"]["before"] == pytest.approx(0.01, rel=0.2)  # the noise, relative to the weights
    assert pair["total"]["before"] - pair["total"]["after"]["all"] < 0.01
    assert "merge directly" in r["reason"]


def test_a_disguise_needs_alignment_and_alignment_undoes_it(bert):
    r = inspect_models([bert["a"], bert["disguised"]], device="cpu")
    pair = r["pairs"][0]
    assert r["verdict"] == ALIGN_FIRST, r["reason"]
    assert pair["total"]["before"] > 0.5
    assert pair["total"]["after"]["all"] < 1e-5
    for row in pair["modules"]:
        assert row["after"]["all"] < 1e-5, row
        assert row["before"] > 0.1, row
    kinds = {k for row in pair["modules"] for k in row["after"]}
    assert {"ffn-permutation", "head-permutation", "rotation", "scaling"} <= kinds
    assert "residual-orthogonal" not in kinds  # post-LN bert: no residual search
    assert "align with symfuse match" in r["reason"]


def test_a_pre_norm_disguise_is_also_undone_by_residual_orthogonal(tmp_path):
    a = save_tiny(tmp_path / "a", "gpt2", seed=0, head="lm")
    d = disguise_checkpoint(a, tmp_path / "d", seed=1, kinds=KINDS)
    pair = inspect_models([a, d], device="cpu")["pairs"][0]
    assert pair["verdict"] == ALIGN_FIRST
    assert pair["whole_model"]["residual_rounds"] >= 1
    assert pair["total"]["after"]["residual-orthogonal"] < 1e-5
    assert pair["whole_model"]["after"]["residual-orthogonal"] < 1e-5


def test_other_shapes_or_families_are_incompatible(bert):
    r = inspect_models([bert["a"], bert["wide"], bert["gpt2"]], device="cpu")
    assert r["verdict"] == INCOMPATIBLE
    wide, gpt2 = r["pairs"]
    assert wide["verdict"] == gpt2["verdict"] == INCOMPATIBLE
    assert not wide["compatible"] and "shapes differ" in wide["reason"] and "d 48" in wide["reason"]
    assert "gpt2" in gpt2["reason"] and "bert" in gpt2["reason"]
    assert "incompatible" in format_report(r)


def test_far_apart_with_little_removed_is_incompatible_without_data():
    total = {"before": 1.4, "after": {"all": 1.33}}
    assert pair_verdict({"total": total})[0] == INCOMPATIBLE
    assert pair_verdict({"total": {"before": 1.4, "after": {"all": 0.9}}})[0] == ALIGN_FIRST
    assert pair_verdict({"total": {"before": 0.05, "after": {"all": 0.045}}})[0] == SAME_BASIN
    # far apart and alignment finds nothing (cut < 1 %): it said same-basin, "merge directly"
    assert pair_verdict({"total": {"before": 1.4, "after": {"all": 1.395}}})[0] == INCOMPATIBLE
    # attention and FFN alike, the whole model far apart (embedding rows in another order): it said same-basin
    outside = {"total": {"before": 0.0, "after": {"all": 0.0}}, "whole_model": {"before": 1.18, "after": {"all": 1.18}}}
    verdict, reason = pair_verdict(outside)
    assert verdict == INCOMPATIBLE and "outside attention / FFN (embeddings, norms, head) differ" in reason
    near = {"total": {"before": 0.0, "after": {"all": 0.0}}, "whole_model": {"before": 0.02, "after": {"all": 0.02}}}
    assert pair_verdict(near)[0] == SAME_BASIN


def test_with_data_the_barrier_agrees_with_the_barrier_code(tmp_path):
    a = save_tiny_text_classifier(tmp_path / "a", seed=0)
    b = disguise_checkpoint(a, tmp_path / "b", seed=1, noise=0.3, kinds=KINDS)
    data = str(toy_dataset(tmp_path / "toy"))
    r = inspect_models([a, b], data=data, device="cpu", max_examples=8)
    paths = r["pairs"][0]["data"]
    assert paths["lambdas"] == [0.0, 0.25, 0.5, 0.75, 1.0] and paths["examples"] == 8
    ref = loss_barrier(a, b, data, tmp_path / "barrier", points=5, max_examples=8, device="cpu")
    assert paths["plain"]["losses"] == pytest.approx(ref["losses"], rel=1e-6, abs=1e-7)
    assert paths["plain"]["barrier"] == pytest.approx(ref["barrier"], abs=1e-6)
    aligned = paths["aligned"]
    assert aligned["losses"][-1] == pytest.approx(paths["plain"]["losses"][-1], abs=1e-6)  # the same function
    assert aligned["ensemble"]["rel_logit_distance"] <= paths["plain"]["ensemble"]["rel_logit_distance"]
    assert 0 <= aligned["ensemble"]["top1_agreement"] <= 1
    figure = plot_report(r, tmp_path / "inspect.png")
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_heads_of_other_shapes_are_left_out_and_refused_with_data(tmp_path):
    a = save_tiny_text_classifier(tmp_path / "a", seed=0, num_labels=2)
    b = save_tiny_text_classifier(tmp_path / "b", seed=1, num_labels=3)
    pair = inspect_models([a, b], device="cpu")["pairs"][0]
    assert pair["compatible"] and pair["left_out"] == ["classifier.bias", "classifier.weight"]
    with pytest.raises(UsageError, match="heads differ"):
        inspect_models([a, b], data=str(toy_dataset(tmp_path / "toy")), device="cpu")


def test_one_model_is_refused(bert):
    with pytest.raises(UsageError, match="at least two"):
        inspect_models([bert["a"]])


def test_a_run_report_opens_with_the_verdict_and_its_figures(bert, tmp_path):
    from symfuse.report import build_report
    from tests.symfuse.test_report import _evals

    record = inspect_models([bert["a"], bert["disguised"]], device="cpu")
    text = build_report(_evals(), [], [], tmp_path, facts={"run": "t"}, inspection=record).markdown
    sections = text.split("\n## ")
    assert sections[1].startswith("Will these models merge?")  # the first section, before the metrics
    assert f"**Verdict: align-first** — {record['reason']}" in sections[1]
    total = record["pairs"][0]["total"]
    row = f"| {record['pairs'][0]['model']} | align-first | {total['before']:.4g} | {total['after']['all']:.4g} |"
    assert row in sections[1]
    assert "Will these models merge?" not in build_report(_evals(), [], [], tmp_path / "none").markdown


def test_heads_naming_their_classes_differently_are_refused_with_data_before_any_work(tmp_path):
    import json

    a = save_tiny_text_classifier(tmp_path / "a", seed=0, num_labels=2)
    b = save_tiny_text_classifier(tmp_path / "b", seed=1, num_labels=2)
    for folder, names in ((a, ["anger", "joy"]), (b, ["joy", "anger"])):  # one shape, two orders
        cfg = json.loads((folder / "config.json").read_text())
        cfg |= {"id2label": dict(enumerate(names)), "label2id": {n: i for i, n in enumerate(names)}}
        (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UsageError, match=r"--data: their heads name their classes differently \(anger, joy / joy, "):
        inspect_models([a, b], data=str(toy_dataset(tmp_path / "toy")), device="cpu")
    assert inspect_models([a, b], device="cpu")["pairs"][0]["compatible"]  # without data: weights only


def test_an_xlm_roberta_classifier_is_scored_by_its_head_not_as_a_language_model(tmp_path):
    """``XLMRobertaForSequenceClassification`` holds "LM" in its name: inspect took it for a causal LM and scored
    its two class logits as next-token predictions (the barrier then differed from ``barrier``'s)."""
    import transformers as T

    from symfuse.checkpoint import resolve_checkpoint
    from tests.tiny import _SMALL

    tok = T.AutoTokenizer.from_pretrained(str(resolve_checkpoint("minilm")))
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        cfg = T.XLMRobertaConfig(vocab_size=tok.vocab_size, max_position_embeddings=70, pad_token_id=1, **_SMALL)
        T.XLMRobertaForSequenceClassification(cfg).save_pretrained(tmp_path / str(seed))
        tok.save_pretrained(tmp_path / str(seed))
        models.append(tmp_path / str(seed))
    data = str(toy_dataset(tmp_path / "toy"))
    paths = inspect_models(models, data=data, device="cpu", max_examples=8)["pairs"][0]["data"]
    ref = loss_barrier(*models, data, tmp_path / "barrier", points=5, max_examples=8, device="cpu")
    assert paths["plain"]["losses"] == pytest.approx(ref["losses"], rel=1e-6, abs=1e-7)
