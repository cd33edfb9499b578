import json

import pytest
import torch

from symfuse.data import DatasetError, encode_split, load_task_dataset, make_batches, shared_label_names
from symfuse.data.batches import IGNORE_INDEX, collate


def _write(folder, split, rows, meta=None):
    folder.mkdir(exist_ok=True)
    (folder / f"{split}.jsonl").write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    if meta is not None:
        (folder / "meta.json").write_text(json.dumps(meta))


def test_bare_shared_name_and_seeded_subsample():
    a = load_task_dataset("dair_emotion", max_train_examples=50, seed=1)
    b = load_task_dataset("dair_emotion", max_train_examples=50, seed=1)
    c = load_task_dataset("dair_emotion", max_train_examples=50, seed=2)
    assert a.labels == ["anger", "fear", "joy", "love", "sadness", "surprise"]
    assert len(a.splits["train"]) == 50 and len(a.splits["test"]) == 2000
    assert a.splits["train"]["text"] == b.splits["train"]["text"] != c.splits["train"]["text"]
    assert a.fingerprint == b.fingerprint != c.fingerprint
    assert a.problem_type == "single_label_classification"


def test_bad_record_names_file_and_line(tmp_path):
    meta = {"task": "classification", "labels": ["joy", "anger"]}
    good = {"text": "ok", "label": "joy"}
    _write(tmp_path / "d", "train", [good, good, {"text": "x", "label": "love"}], meta)
    # the fix names meta.json too: it may be the list that lacks the class (it blamed the record alone)
    with pytest.raises(
        DatasetError,
        match=r"train\.jsonl:3: .*unknown label 'love' \(meta\.json lists \['anger', "
        r"'joy'\]: add it there if it is a class\) — fix or remove that line",
    ):
        load_task_dataset(str(tmp_path / "d"))
    _write(tmp_path / "d", "train", [good, "{not json", good], meta)
    with pytest.raises(DatasetError, match=r"train\.jsonl:2: not valid JSON"):
        load_task_dataset(str(tmp_path / "d"))
    _write(tmp_path / "d", "train", [good, good, "", {"label": "joy"}], meta)
    with pytest.raises(DatasetError, match=r"train\.jsonl:4: .*'text'"):
        load_task_dataset(str(tmp_path / "d"))
    boolean = {"task": "classification", "labels": ["False", "True"]}  # str(True): passed the check, then KeyError
    _write(tmp_path / "b", "train", [{"text": "ok", "label": True}, {"text": "no", "label": False}], boolean)
    with pytest.raises(DatasetError, match=r'train\.jsonl:1: .*label true is a JSON boolean — write the class as a '
                                           r'string \("true"\)'):  # fmt: skip
        load_task_dataset(str(tmp_path / "b"))
    mixed = [{"text": "a", "label": "x"}, {"text": "b", "label": 1}]  # the loader read '"x"': KeyError in training
    _write(tmp_path / "m", "train", mixed, None)
    with pytest.raises(DatasetError, match=r'train\.jsonl:2: .*label 1 and line 1\'s "x" are of two JSON kinds'):
        load_task_dataset(str(tmp_path / "m"))
    _write(tmp_path / "two", "train", [good, good], meta)  # train.jsonl was read, train.csv ignored without a word
    (tmp_path / "two" / "train.csv").write_text("text,label\nok,anger\n")
    with pytest.raises(DatasetError, match=r"two: train\.jsonl and train\.csv are both the train split — keep one"):
        load_task_dataset(str(tmp_path / "two"))
    ner = {"task": "ner", "tags": ["B-x", "I-x", "O"]}
    _write(tmp_path / "n", "train", [{"tokens": ["a", "b"], "tags": ["B-x"]}], ner)
    with pytest.raises(DatasetError, match=r"train\.jsonl:1: .*one tag per token"):
        load_task_dataset(str(tmp_path / "n"))


def test_ner_tags_outside_the_scheme_seqeval_scores_are_refused(tmp_path):
    """seqeval reads 'PER' (IO tags) as outside every entity: such a set trained, then scored entity F1 0."""
    rows = [{"tokens": ["Ann", "runs"], "tags": ["PER", "O"]}] * 2
    _write(tmp_path / "io", "train", rows, {"task": "ner", "tags": ["PER", "O"]})
    with pytest.raises(DatasetError, match=r"io/meta\.json: tags lists 'PER', which is not O or a B- / I- / E- / S- "
                                           r"prefix and an entity type .* such as B-PER / I-PER / O"):  # fmt: skip
        load_task_dataset(str(tmp_path / "io"))
    (tmp_path / "io" / "meta.json").unlink()  # inferred from the records: named at the first record holding one
    with pytest.raises(DatasetError, match=r"io/train\.jsonl:1: bad ner record: tag 'PER' is not O or a B- "):
        load_task_dataset(str(tmp_path / "io"))
    _write(tmp_path / "int", "train", [{"tokens": ["a"], "tags": [1]}], None)
    with pytest.raises(DatasetError, match=r"int/train\.jsonl:1: bad ner record: tag 1 is not O"):
        load_task_dataset(str(tmp_path / "int"))
    iobes = [{"tokens": ["Ann", "Lee", "runs", "Rome"], "tags": ["B-PER", "E-PER", "O", "S-LOC"]}] * 2
    _write(tmp_path / "iobes", "train", iobes, None)
    assert load_task_dataset(str(tmp_path / "iobes")).labels == ["B-PER", "E-PER", "O", "S-LOC"]


def test_bad_meta_and_bytes_name_the_file_line_and_fix(tmp_path):
    meta = {"task": "classification", "labels": ["joy", "anger"]}
    good = {"text": "ok", "label": "joy"}
    _write(tmp_path / "d", "train", [good, good], meta)
    (tmp_path / "d" / "meta.json").write_text('{\n  "task": "classification",\n  labels: ["joy"]\n}\n')
    with pytest.raises(DatasetError, match=r"meta\.json:3:3: not valid JSON \(Expecting property.* — fix the file"):
        load_task_dataset(str(tmp_path / "d"))
    (tmp_path / "d" / "meta.json").write_text(json.dumps({"task": "classification", "labels": "joy"}))
    with pytest.raises(DatasetError, match=r"meta\.json: labels must be a list of class names"):
        load_task_dataset(str(tmp_path / "d"))
    for labels, twice in ((["anger", "joy", "joy"], "'joy'"), (["Joy", "anger", "joy"], "'Joy' and 'joy'")):
        (tmp_path / "d" / "meta.json").write_text(json.dumps({"task": "classification", "labels": labels}))
        with pytest.raises(DatasetError, match=rf"meta\.json: labels lists {twice} twice .* — list each class once"):
            load_task_dataset(str(tmp_path / "d"))  # a head got two outputs named joy, one never trained
    (tmp_path / "d" / "meta.json").write_text(json.dumps({"task": "classification", "labels": []}))
    with pytest.raises(DatasetError, match=r"meta\.json: labels is an empty list — list the classes, or remove"):
        load_task_dataset(str(tmp_path / "d"))  # it inferred the classes from the records without a word
    _write(
        tmp_path / "r0",
        "train",
        [{"text": "a", "text_pair": "b", "label": 1.5}] * 2,
        {"task": "regression", "labels": []},
    )
    assert load_task_dataset(str(tmp_path / "r0")).labels == []  # regression has no classes to list
    _write(tmp_path / "blank", "train", [{"text": "", "label": "joy"}, {"text": "  ", "label": "anger"}], meta)
    with pytest.raises(DatasetError, match=r"blank/train\.jsonl: every record's text is empty"):
        load_task_dataset(str(tmp_path / "blank"))
    reg = {"task": "regression"}
    for label, shown in ((float("nan"), "NaN"), (float("inf"), "Infinity"), (True, "true")):
        _write(tmp_path / "r", "train", [{"text": "a", "text_pair": "b", "label": 1.5}] * 2 +
               [{"text": "a", "text_pair": "b", "label": label}], reg)  # fmt: skip
        with pytest.raises(DatasetError, match=rf"r/train\.jsonl:3: .*label {shown} is not a finite number"):
            load_task_dataset(str(tmp_path / "r"))
    _write(tmp_path / "nt", "train", [{"tokens": [], "tags": []}] * 2, {"task": "ner", "tags": ["B-x", "I-x", "O"]})
    with pytest.raises(DatasetError, match=r"nt/train\.jsonl: every record's tokens is empty"):
        load_task_dataset(str(tmp_path / "nt"))
    multi = {"task": "classification", "multi_label": True, "labels": ["joy", "anger"]}
    _write(tmp_path / "ml", "train", [{"text": "a", "label": []}] * 2, multi)
    with pytest.raises(DatasetError, match=r"ml/train\.jsonl: every record's label is empty"):
        load_task_dataset(str(tmp_path / "ml"))
    _write(tmp_path / "cased", "train", [good, {"text": "x", "label": "Joy"}, {"text": "y", "label": "anger"}])
    with pytest.raises(DatasetError, match=r"cased: the records spell one class two ways \('Joy' and 'joy'; "):
        load_task_dataset(str(tmp_path / "cased"))  # no meta.json: the classes come from the records
    (tmp_path / "d" / "meta.json").write_text(json.dumps({"task": "summarization"}))
    with pytest.raises(DatasetError, match=r"meta\.json: unknown task 'summarization' — give one of classification, "
                                           r"pair_classification, regression, ner \(or language_modeling"):  # fmt: skip
        load_task_dataset(str(tmp_path / "d"))
    (tmp_path / "d" / "meta.json").write_text(json.dumps(meta))
    train = tmp_path / "d" / "train.jsonl"
    train.write_bytes(train.read_bytes() + '{"text": "café", "label": "joy"}\n'.encode("latin-1"))
    with pytest.raises(DatasetError, match=r"train\.jsonl:3: not UTF-8 \(byte 0xe9 at column 14\) — re-save it"):
        load_task_dataset(str(tmp_path / "d"))
    csv = tmp_path / "small.csv"
    csv.write_bytes("text,label\nhello,pos\ncaf\xe9,neg\n".encode("latin-1"))
    with pytest.raises(DatasetError, match=r"small\.csv:3: not UTF-8"):
        load_task_dataset(str(csv))


def test_local_csv_inferred(tmp_path):
    f = tmp_path / "small.csv"
    f.write_text("text,label\nhello,pos\nbad day,neg\nfine,pos\n")
    ds = load_task_dataset(str(f))
    assert ds.task == "classification" and ds.labels == ["neg", "pos"]
    assert ds.splits["test"]["label"] == ["pos", "neg", "pos"]
    b = make_batches(ds, "minilm", "test", batch_size=2, max_length=16)
    assert [x["labels"].tolist() for x in b] == [[1, 0], [1]]


def test_csv_cells_are_read_as_the_check_read_them(tmp_path):
    """pandas (datasets' CSV reader) turned 01 into 1, NA into None and True into a bool after the check had read
    strings: an internal KeyError at encoding; numeric or "null" texts reached the tokenizer as numbers / None."""
    f = tmp_path / "cells.csv"
    f.write_text("text,label\nnull,01\n123,NA\nfine,True\n")
    (tmp_path / "meta.json").write_text(json.dumps({"task": "classification", "labels": ["01", "NA", "True"]}))
    ds = load_task_dataset(f"test={f}")
    assert ds.splits["test"]["label"] == ["01", "NA", "True"] and ds.splits["test"]["text"] == ["null", "123", "fine"]
    assert [x["labels"].tolist() for x in make_batches(ds, "minilm", "test", batch_size=3, max_length=8)] == [[0, 1, 2]]
    (tmp_path / "sts").mkdir()
    (tmp_path / "sts" / "test.csv").write_text("text,text_pair,label\na cat,a dog,0.5\nred,blue,4\n")
    (tmp_path / "sts" / "meta.json").write_text(json.dumps({"task": "regression"}))
    assert load_task_dataset(str(tmp_path / "sts")).splits["test"]["label"] == [0.5, 4.0]  # regression: numbers


@pytest.mark.parametrize(
    ("name", "text", "words"),
    [
        # datasets kept the first "label" column, the check read the last: another column scored, exit 0
        ("twice.csv", "text,label,label\nhi,joy,anger\n", r"twice\.csv:1: the header names column 'label' twice"),
        ("extra.csv", "text,label\nhi,joy\nhi, there,joy\n", r"extra\.csv:3: 1 more field\(s\) than the header"),
        # datasets' three-line "could not read the files" named neither the line nor the cause
        ("dup.jsonl", '{"text": "hi", "label": "joy", "label": "anger"}\n', r"dup\.jsonl:1: key 'label' appears"),
        ("arr.json", '["i feel happy", "i feel sad"]', r"arr\.json: item 1 of the array is a str, not a record"),
        ("lone.jsonl", '{"text": "a \\ud800 b", "label": "joy"}\n', r"lone\.jsonl:1: a string holds a lone UTF-16"),
    ],
)
def test_a_record_the_check_and_the_reader_would_read_apart_is_refused(tmp_path, name, text, words):
    (tmp_path / name).write_text(text)
    with pytest.raises(DatasetError, match=words):
        load_task_dataset(str(tmp_path / name))


def test_a_line_separator_inside_a_json_string_is_text(tmp_path):
    """str.splitlines broke the record at U+2028: "not valid JSON (Unterminated string ...)"."""
    f = tmp_path / "seps.jsonl"
    f.write_text(json.dumps({"text": "one\u2028two\u0085three", "label": "joy"}, ensure_ascii=False) + "\n")
    assert load_task_dataset(str(f)).splits["test"]["text"] == ["one\u2028two\u0085three"]


def test_multi_label_must_be_a_json_boolean(tmp_path):
    meta = {"task": "classification", "multi_label": "false"}  # bool("false") is True: read as multi-label
    _write(tmp_path / "m", "train", [{"text": "ok", "label": "joy"}], meta)
    with pytest.raises(DatasetError, match=r"meta\.json: multi_label is 'false', not true or false"):
        load_task_dataset(str(tmp_path / "m"))


def test_ner_labels_on_first_subtoken(tmp_path):
    meta = {"task": "ner", "tags": ["B-person", "I-person", "O"]}
    rec = {"tokens": ["Jailed", "Fatos", "Nano", "."], "tags": ["O", "B-person", "I-person", "O"]}
    _write(tmp_path / "n", "train", [rec], meta)
    ds = load_task_dataset(str(tmp_path / "n"))
    from symfuse.data import load_tokenizer

    tok = load_tokenizer("minilm")
    (f,) = encode_split(ds, tok, "train", max_length=32)
    words = tok(["Jailed", "Fatos", "Nano", "."], is_split_into_words=True).word_ids()
    assert len(set(w for w in words if w is not None)) == 4 and len(words) > 6  # some words split in sub-tokens
    expected, prev = [], None
    for w in words:
        expected.append(IGNORE_INDEX if w is None or w == prev else [2, 0, 1, 2][w])
        prev = w
    assert f["labels"] == expected
    assert f["labels"][0] == IGNORE_INDEX and f["labels"][-1] == IGNORE_INDEX


def test_entity_tags_cut_off_by_max_length_are_said(tmp_path, caplog):
    """Tagged words past max_length were neither scored nor counted: recall over the words kept, without a word."""
    meta = {"task": "ner", "tags": ["B-person", "I-person", "O"]}
    rec = {"tokens": ["Jailed", "Fatos", "Nano", "."], "tags": ["O", "B-person", "I-person", "O"]}
    _write(tmp_path / "n", "train", [rec], meta)
    ds = load_task_dataset(str(tmp_path / "n"))

    def said():
        return [r.getMessage() for r in caplog.records if r.name == "symfuse.data.batches" and r.levelname == "WARNING"]

    with caplog.at_level("WARNING", logger="symfuse.data.batches"):
        encode_split(ds, "minilm", "train", max_length=32)
        assert not said()
        (f,) = encode_split(ds, "minilm", "train", max_length=4)  # [CLS] Jailed + one sub-token of Fatos, [SEP]
    assert sum(label != IGNORE_INDEX for label in f["labels"]) == 2
    assert said() == [
        "n/train: 1 of 2 entity-tagged words lie past max_length 4 tokens and are left out — raise --max-length to "
        "keep them"
    ]


def test_multilabel_multi_hot_and_pair_regression():
    ds = load_task_dataset("goemotions_ekman", max_train_examples=8)
    (batch,) = make_batches(ds, "minilm", "train", batch_size=8, max_length=32)
    assert batch["labels"].dtype == torch.float32 and batch["labels"].shape == (8, 7)
    rows = ds.splits["train"]["label"]
    for i, names in enumerate(rows):
        assert {ds.labels[j] for j in torch.nonzero(batch["labels"][i]).flatten().tolist()} == set(names)
    sts = load_task_dataset("stsb", max_train_examples=4)
    (b,) = make_batches(sts, "minilm", "train", batch_size=4, max_length=64)
    assert b["labels"].dtype == torch.float32
    assert torch.allclose(b["labels"], torch.tensor(sts.splits["train"]["label"]))
    assert (b["token_type_ids"] == 1).any()  # the pair's second segment


def test_a_model_of_one_token_type_reads_a_pair_without_segments(tmp_path):
    """A BERT with ``type_vocab_size: 1`` was handed the pair's second segment as type 1: IndexError inside its
    embeddings (finetune, evaluate, stats). Its tokenizer writes no segments now, as RoBERTa's does."""
    import transformers as T

    from tests.tiny import save_tiny_text_classifier

    folder = save_tiny_text_classifier(tmp_path / "m")
    config = T.AutoConfig.from_pretrained(folder)
    config.type_vocab_size = 1
    model = T.BertForSequenceClassification(config).eval()
    model.save_pretrained(folder)
    sts = load_task_dataset("stsb", max_train_examples=4)
    (b,) = make_batches(sts, str(folder), "train", batch_size=4, max_length=64)
    assert "token_type_ids" not in b
    with torch.no_grad():
        assert model(**{k: v for k, v in b.items() if k != "labels"}).logits.shape == (4, 2)
    (two,) = make_batches(sts, "minilm", "train", batch_size=4, max_length=64)  # two token types: segments kept
    assert torch.equal(two["input_ids"], b["input_ids"]) and (two["token_type_ids"] == 1).any()


def test_collate_pads_right():
    batch = collate(
        [
            {"input_ids": [1, 2, 3], "attention_mask": [1, 1, 1], "labels": [0, 1, 2]},
            {"input_ids": [1], "attention_mask": [1], "labels": [2]},
        ],
        pad_token_id=0,
    )
    assert batch["input_ids"].tolist() == [[1, 2, 3], [1, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[0, 1, 2], [2, -100, -100]]


def test_shared_label_names():
    assert shared_label_names(
        ["anger", "fear", "joy", "love", "sadness", "surprise"],
        ["anger", "disgust", "fear", "joy", "neutral", "sadness", "surprise"],
    ) == ["anger", "fear", "joy", "sadness", "surprise"]


def test_unknown_bare_name_fails_fast_with_suggestion():
    with pytest.raises(DatasetError, match="did you mean dair_emotion"):
        load_task_dataset("dair_emotoin")
