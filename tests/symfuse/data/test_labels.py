"""Whether data's classes can be a head's: by name, or by count for heads saved without names (LABEL_i)."""

from symfuse.data.labels import data_mismatch, foreign_classes, head_labels


def test_head_labels_read_config_json_and_its_defaults():
    assert head_labels({"architectures": ["BertModel"]}) is None  # no classification head
    assert head_labels({"architectures": ["BertForSequenceClassification"]}) == ["LABEL_0", "LABEL_1"]
    config = {"architectures": ["BertForTokenClassification"], "id2label": {"1": "B-x", "0": "O", "2": "I-x"}}
    assert head_labels(config) == ["O", "B-x", "I-x"]


def test_data_of_a_head_shares_a_class_or_has_as_many_classes_as_unnamed_outputs():
    assert data_mismatch(["Joy", "anger"], ["joy", "fear"]) is None  # case-insensitive
    assert data_mismatch(["red", "blue"], ["joy", "fear"]) == (
        "shares no class with the head (red, blue); its classes: joy, fear"
    )
    assert data_mismatch(["LABEL_0", "LABEL_1"], ["joy", "fear"]) is None
    assert data_mismatch(["LABEL_0", "LABEL_1"], ["a", "b", "c"]) == "has 3 classes for a head of 2 unnamed outputs"
    assert data_mismatch(["LABEL_0"], [], regression=True) is None  # regression data for a regression head
    assert data_mismatch(["joy", "anger"], [], regression=True) == (  # a head refit read STS-B scores, exit 0
        "holds regression scores, no classes, for a head of 2 classes (joy, anger)"
    )


def test_fisher_targets_need_every_class_of_the_data_in_the_head():
    assert foreign_classes(["anger", "joy", "fear"], ["joy", "anger"]) is None
    assert (
        foreign_classes(["anger", "joy"], ["joy", "love"]) == "classes the head lacks: love (its classes: anger, joy)"
    )
    assert foreign_classes(["LABEL_0", "LABEL_1", "LABEL_2"], ["a", "b"]) is None
    assert foreign_classes(["LABEL_0"] * 2, list("abcd")) == "4 classes for the 2 unnamed outputs of the head"
