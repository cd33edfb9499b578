import math

import numpy as np
import pytest
import torch

from symfuse.data import TaskDataset
from symfuse.evaluate import accuracy, entity_f1, macro_f1, matthews, pearson_spearman, primary_metric, score_logits


def test_macro_f1_hand_computed():
    # class 0: tp1 fp1 fn0 -> 2/3; class 1: tp1 fp0 fn1 -> 2/3; class 2: 1
    assert macro_f1([0, 0, 1, 2], [0, 1, 1, 2]) == pytest.approx((2 / 3 + 2 / 3 + 1) / 3)
    # multi-hot: col0 tp1 fp0 fn1 -> 2/3, col1 tp1 fp1 fn0 -> 2/3, col2 absent everywhere -> not averaged
    pred = np.array([[1, 1, 0], [0, 1, 0]])
    gold = np.array([[1, 1, 0], [1, 0, 0]])
    assert macro_f1(pred, gold) == pytest.approx(2 / 3)


def test_accuracy_matthews_pearson_hand_computed():
    assert accuracy([1, 2, 3, 4], [1, 2, 0, 4]) == 0.75
    # TP=1 FP=1 TN=2 FN=0 -> (1*2 - 1*0) / sqrt(2*1*3*2)
    assert matthews([1, 1, 0, 0], [1, 0, 0, 0]) == pytest.approx(2 / math.sqrt(12))
    assert matthews([0, 1, 2], [0, 1, 2]) == pytest.approx(1.0)
    gold = [0.0, 1.0, 2.5, 4.0]
    r = pearson_spearman([2 * g + 1 for g in gold], gold)
    assert r["pearson"] == pytest.approx(1.0) and r["spearman"] == pytest.approx(1.0)
    r = pearson_spearman([1.0, 0.0, 3.0, 2.0], [0.0, 1.0, 2.0, 3.0])
    assert r["spearman"] == pytest.approx(0.6) and r["pearson"] == pytest.approx(0.6)


def test_seqeval_entity_spans():
    gold = [["B-person", "I-person", "O", "B-location"]]
    # the person span is cut short: wrong entity; the location is right -> P = R = F1 = 1/2
    out = entity_f1([["B-person", "O", "O", "B-location"]], gold)
    assert (out["precision"], out["recall"], out["f1"]) == (0.5, 0.5, 0.5)
    assert out["token_accuracy"] == 0.75
    # wrong type on the right span counts as wrong; a missed entity lowers recall only
    out = entity_f1([["B-location", "I-location", "O", "O"]], gold)
    assert (out["precision"], out["recall"], out["f1"]) == (0.0, 0.0, 0.0)
    out = entity_f1([["B-person", "I-person", "O", "O"]], gold)
    assert (out["precision"], out["recall"]) == (1.0, 0.5) and out["f1"] == pytest.approx(2 / 3)


def test_primary_metric():
    assert primary_metric("cola", "single_label_classification") == "matthews"
    assert primary_metric("rte", "single_label_classification") == "accuracy"
    assert primary_metric("stsb", "regression") == "pearson"
    assert primary_metric("conll2003", "token_classification") == "f1"
    assert primary_metric("meld", "single_label_classification") == "macro_f1"


def _ds(labels, task="classification", multi=False, name="x"):
    return TaskDataset(name=name, task=task, multi_label=multi, labels=labels, splits={})


def test_out_of_domain_scoring_maps_by_name_over_shared_classes():
    data = _ds(["anger", "fear", "joy"])
    head = ["joy", "anger", "love"]  # other order, no fear, extra love
    logits = torch.tensor(
        [
            [0.0, 1.0, 9.0],  # love wins overall, anger among shared -> anger
            [5.0, 0.0, 0.0],  # gold fear: not shared -> dropped
            [2.0, 1.0, 0.0],  # joy
            [0.0, 3.0, 0.0],  # anger, gold joy -> wrong
        ]
    )
    gold = torch.tensor([0, 1, 2, 2])  # anger fear joy joy (dataset ids)
    m = score_logits(data, head, "single_label_classification", [logits], [gold])
    assert m["classes"] == ["anger", "joy"] and m["n"] == 3 and not m["in_domain"]
    # anger: tp1 fp1 fn0 -> 2/3; joy: tp1 fp0 fn1 -> 2/3
    assert m["macro_f1"] == pytest.approx(2 / 3) and m["accuracy"] == pytest.approx(2 / 3)
    # in-domain with permuted head ids: predictions are mapped by name
    m = score_logits(data, ["joy", "fear", "anger"], "single_label_classification", [logits], [gold])
    assert m["in_domain"] and m["n"] == 4
    # head joy,fear,anger -> predicted names: anger, joy, joy, fear ; gold anger fear joy joy -> 2 right
    assert m["accuracy"] == pytest.approx(0.5)


def test_a_fixed_scored_class_set_keeps_the_classes_a_head_lacks_at_f1_zero():
    """``scored``: the same classes for every head; one the head lacks is never predicted and its gold examples stay
    (F1 0 in the macro mean), where the default drops them and scores an easier task."""
    data = _ds(["anger", "fear", "joy"])
    head = ["joy", "anger", "love"]  # no fear
    logits = torch.tensor([[0.0, 1.0, 9.0], [5.0, 0.0, 0.0], [2.0, 1.0, 0.0], [0.0, 3.0, 0.0]])
    gold = torch.tensor([0, 1, 2, 2])  # anger fear joy joy
    m = score_logits(data, head, "single_label_classification", [logits], [gold], scored=["Anger", "fear", "joy"])
    assert m["classes"] == ["anger", "fear", "joy"] and m["n"] == 4 and not m["in_domain"]
    # predictions anger, joy, joy, anger. anger: tp1 fp1 fn0 -> 2/3; fear: tp0 fn1 -> 0; joy: tp1 fp1 fn1 -> 1/2
    assert m["per_class_f1"] == pytest.approx({"anger": 2 / 3, "fear": 0.0, "joy": 0.5})
    assert m["macro_f1"] == pytest.approx((2 / 3 + 0.0 + 0.5) / 3) and m["accuracy"] == pytest.approx(0.5)
    easier = score_logits(data, head, "single_label_classification", [logits], [gold])
    assert easier["n"] == 3 and easier["macro_f1"] > m["macro_f1"]
    # a head with none of the scored classes predicts none of them: every F1 is 0 (not "always the first class")
    none = score_logits(data, head, "single_label_classification", [logits], [gold], scored=["fear"])
    assert none["classes"] == ["fear"] and none["n"] == 1 and none["macro_f1"] == 0.0 and none["accuracy"] == 0.0
    # in domain, ``scored`` changes nothing
    own = score_logits(data, ["joy", "fear", "anger"], "single_label_classification", [logits], [gold], scored=["joy"])
    assert own["classes"] == ["anger", "fear", "joy"] and own["in_domain"]


def test_union_head_in_domain_scores_every_dataset_class_with_one_class_per_example():
    # a multi-label union head (names in another case) on its single-label in-domain data: argmax over the
    # dataset's classes (never "Fear", which this dataset lacks), Matthews reported
    data = _ds(["anger", "joy"])
    head = ["Joy", "fear", "Anger"]
    logits = torch.tensor([[-1.0, 9.0, -2.0], [-3.0, 9.0, -1.0], [-2.0, 9.0, -3.0], [-4.0, 9.0, -5.0]])
    gold = torch.tensor([1, 0, 1, 1])  # joy, anger, joy, joy
    m = score_logits(data, head, "multi_label_classification", [logits], [gold], in_domain=True)
    assert m["classes"] == ["anger", "joy"] and m["in_domain"] and m["n"] == 4
    # predictions: joy (-1 > -2), anger (-1 > -3), joy, joy: all right although no sigmoid is above 0.5
    assert m["accuracy"] == 1.0 and m["matthews"] == pytest.approx(1.0) and m["macro_f1"] == 1.0
    ood = score_logits(_ds(["anger", "joy", "neutral"]), head, "multi_label_classification", [logits], [gold])
    assert ood["classes"] == ["anger", "joy"] and not ood["in_domain"]
    # out of domain too, one class per example (argmax over the shared classes), not sigmoid > 0.5 (none would be)
    assert ood["accuracy"] == 1.0 and ood["macro_f1"] == 1.0


def test_multilabel_gold_against_single_label_head():
    data = _ds(["anger", "joy", "neutral"], multi=True)
    head = ["anger", "joy", "love"]
    logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 2.0, 0.0], [2.0, 0.0, 0.0]])
    gold = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])  # row 2 neutral only -> dropped
    m = score_logits(data, head, "single_label_classification", [logits], [gold])
    assert m["n"] == 2 and m["classes"] == ["anger", "joy"]
    # anger: tp2 -> 1.0 ; joy: fn1 -> 0.0
    assert m["per_class_f1"] == {"anger": 1.0, "joy": 0.0} and m["macro_f1"] == pytest.approx(0.5)


def test_ner_scoring_maps_tags_by_name():
    data = _ds(["B-person", "I-person", "B-song", "O"], task="ner")
    head = ["O", "B-person", "I-person", "B-location"]
    # gold: B-person I-person B-song O ; -100 on a later sub-token
    gold = torch.tensor([[-100, 0, 1, -100, 2, 3, -100]])
    z = torch.full((1, 7, 4), -5.0)
    for pos, tag in zip([1, 2, 4, 5], [1, 2, 3, 0], strict=True):  # person span right; location predicted at song
        z[0, pos, tag] = 5.0
    m = score_logits(data, head, "token_classification", [z], [gold])
    # location is not a dataset type and song not a head type: both ignored -> the person entity is all that counts
    assert m["entity_types"] == ["person"] and m["f1"] == 1.0


def test_metrics_table(tmp_path):
    import json

    from symfuse.evaluate import metrics_table

    f = tmp_path / "b.json"
    f.write_text(
        json.dumps(
            {
                "model": "m1",
                "dataset": "meld",
                "split": "test",
                "primary": "macro_f1",
                "macro_f1": 0.25,
                "n": 4,
                "per_class_f1": {"joy": 0.5},
            }
        )
    )
    a = {"model": "m2", "dataset": "cola", "split": "test", "primary": "matthews", "matthews": 0.1, "n": 3}
    df = metrics_table([f, a])
    assert list(df["dataset"]) == ["cola", "meld"] and list(df["score"]) == [0.1, 0.25]
    assert list(df.columns[:6]) == ["model", "dataset", "split", "primary", "score", "n"]
    assert "per_class_f1" not in df.columns
