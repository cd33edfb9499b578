import json

import pytest
import torch

from symfuse.data import iter_batches, load_task_dataset, load_tokenizer
from symfuse.data.batches import encode_split
from symfuse.evaluate import evaluate_model, load_task_model, run_model
from symfuse.train import TRAIN_REPORT, FinetuneConfig, finetune, train_model
from symfuse.train.finetune import _build_model
from tests.symfuse.train.helpers import save_tiny_base


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory):
    return save_tiny_base(tmp_path_factory.mktemp("tiny") / "base")


def _val_loss(model, ds, tok, cfg):
    batches = list(
        iter_batches(encode_split(ds, tok, "validation", cfg.max_length, cfg.max_eval_examples, cfg.seed), 64)
    )
    return run_model(model, batches, ds.problem_type)[2]


def _finetune_reduces_val_loss(base, lr, epochs):
    cfg = FinetuneConfig(
        epochs=epochs, lr=lr, max_length=64, max_train_examples=200, max_eval_examples=200, progress=False
    )
    ds = load_task_dataset("dair_emotion", max_train_examples=200, seed=cfg.seed)
    tok = load_tokenizer(base)
    model = _build_model(base, ds, cfg)
    before = _val_loss(model, ds, tok, cfg)
    snapshot = {k: v.clone() for k, v in model.state_dict().items()}
    trained, history = train_model(model, ds, tok, cfg)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in snapshot.items())  # input model untouched
    assert [h["epoch"] for h in history] == list(range(1, epochs + 1))
    assert sum(h["best"] for h in history) == 1
    best = min(h["val_loss"] for h in history)
    assert best < before - 0.02, (before, history)
    assert _val_loss(trained, ds, tok, cfg) == pytest.approx(
        next(h for h in history if h.get("best"))["val_loss"], abs=1e-5
    )


def test_finetune_200_dair_emotion_reduces_val_loss_tiny(tiny_base):
    _finetune_reduces_val_loss(tiny_base, lr=1e-3, epochs=2)


@pytest.mark.slow
def test_finetune_200_dair_emotion_reduces_val_loss_minilm():
    from symfuse.checkpoint import resolve_checkpoint

    _finetune_reduces_val_loss(resolve_checkpoint("minilm"), lr=1e-4, epochs=2)


def test_grad_accumulation_matches_large_batch(tiny_base):
    ds = load_task_dataset("dair_emotion", max_train_examples=32)
    tok = load_tokenizer(tiny_base)
    common = dict(epochs=1, lr=1e-3, max_length=48, max_eval_examples=8, dropout=0.0, progress=False)
    big = FinetuneConfig(batch_size=16, grad_accum=1, **common)
    small = FinetuneConfig(batch_size=8, grad_accum=2, **common)
    start = _build_model(tiny_base, ds, big)
    a, ha = train_model(start, ds, tok, big)
    b, hb = train_model(start, ds, tok, small)
    sa, sb, s0 = a.state_dict(), b.state_dict(), start.state_dict()
    moved = max((sa[k] - s0[k]).abs().max().item() for k in sa if sa[k].is_floating_point())
    diff = max((sa[k] - sb[k]).abs().max().item() for k in sa if sa[k].is_floating_point())
    assert moved > 1e-4
    assert diff < 1e-5, diff
    assert ha[0]["train_loss"] == pytest.approx(hb[0]["train_loss"], abs=1e-5)


@pytest.mark.parametrize(
    ("data", "head", "problem"),
    [
        ("goemotions_ekman", "BertForSequenceClassification", "multi_label_classification"),
        ("crossner_ai", "BertForTokenClassification", "token_classification"),
    ],
)
def test_heads_round_trip_through_save_and_load(tiny_base, tmp_path, data, head, problem):
    cfg = FinetuneConfig(epochs=1, lr=1e-3, max_length=48, max_train_examples=16, max_eval_examples=16, progress=False)
    out = finetune(tiny_base, data, tmp_path / "ft", cfg)
    report = json.loads((out / TRAIN_REPORT).read_text())
    assert report["problem_type"] == problem and len(report["epochs"]) == 1 and report["data_fingerprint"]
    assert report["config"]["max_train_examples"] == 16
    ds = load_task_dataset(data, max_train_examples=16)
    loaded, tok = load_task_model(out)
    assert type(loaded).__name__ == head
    assert [loaded.config.id2label[i] for i in range(loaded.config.num_labels)] == ds.labels
    # the same seeded run in memory gives the same weights as the saved folder (deterministic on CPU)
    again, _ = train_model(_build_model(tiny_base, ds, cfg), ds, tok, cfg)
    saved = loaded.state_dict()
    for k, v in again.state_dict().items():
        torch.testing.assert_close(saved[k], v, rtol=0, atol=1e-6)
    batch = next(iter_batches(encode_split(ds, tok, "test", 48, 8), 8))
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
            again(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
        )
    metrics = evaluate_model(out, data, max_examples=20, max_length=48, out_file=tmp_path / "m.json")
    primary = metrics["primary"]
    assert primary == ("f1" if problem == "token_classification" else "macro_f1")
    assert 0.0 <= metrics[primary] <= 1.0 and metrics["n"] == 20
    assert json.loads((tmp_path / "m.json").read_text())[primary] == metrics[primary]


def test_concurrent_finetunes_in_threads_are_reproducible(tiny_base, tmp_path):
    # dropout draws from torch's process-wide generator: fine-tunes in threads (Prefect's thread task runner) must
    # still give exactly the weights of a solo run with the same seed
    from concurrent.futures import ThreadPoolExecutor

    from safetensors.torch import load_file

    cfg = FinetuneConfig(
        epochs=1, lr=1e-3, max_length=32, max_train_examples=48, max_eval_examples=8, dropout=0.3, progress=False
    )
    solo = load_file(finetune(tiny_base, "dair_emotion", tmp_path / "solo", cfg) / "model.safetensors")
    with ThreadPoolExecutor(3) as pool:
        outs = list(pool.map(lambda i: finetune(tiny_base, "dair_emotion", tmp_path / f"t{i}", cfg), range(3)))
    for out in outs:
        got = load_file(out / "model.safetensors")
        assert got.keys() == solo.keys()
        assert all(torch.equal(got[k], solo[k]) for k in solo)


def test_new_head_comes_from_its_own_seeded_generator(tiny_base):
    # the head is drawn from torch.Generator(seed + HEAD_SEED_OFFSET) in module order, not from the global generator:
    # closed form N(0, initializer_range) weights and zero biases, the same whatever the global state
    from symfuse.train.finetune import HEAD_SEED_OFFSET

    ds = load_task_dataset("dair_emotion", max_train_examples=16, seed=13)
    cfg = FinetuneConfig(seed=5, progress=False)
    model = _build_model(tiny_base, ds, cfg)
    head = model.classifier
    gen = torch.Generator().manual_seed(5 + HEAD_SEED_OFFSET)
    std = model.config.initializer_range
    expected = torch.empty(head.weight.shape).normal_(0.0, std, generator=gen)
    assert torch.equal(head.weight, expected) and torch.equal(head.bias, torch.zeros_like(head.bias))
    other = _build_model(tiny_base, ds, cfg.model_copy(update={"seed": 6}))
    assert not torch.equal(other.classifier.weight, head.weight)
    # the encoder is the base's: only the head is new
    assert torch.equal(other.bert.embeddings.word_embeddings.weight, model.bert.embeddings.word_embeddings.weight)


def test_head_learning_rate_scale_applies_to_the_head_only(tiny_base):
    # the AdamW groups: the classifier (outside the base model) at lr x head_lr_scale, every other trainable
    # parameter at lr, each parameter in exactly one group, frozen ones in none
    from symfuse.train.finetune import _param_groups

    ds = load_task_dataset("dair_emotion", max_train_examples=16, seed=13)
    cfg = FinetuneConfig(lr=1e-3, head_lr_scale=30, weight_decay=0.0, progress=False)
    model = _build_model(tiny_base, ds, cfg)
    groups = _param_groups(model, cfg)
    head = {id(p) for p in model.classifier.parameters()}
    for group in groups:
        is_head = {id(p) in head for p in group["params"]}
        assert len(is_head) == 1, "a group mixes head and body parameters"
        assert group["lr"] == pytest.approx(3e-2 if is_head.pop() else 1e-3)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert sorted(id(p) for g in groups for p in g["params"]) == sorted(id(p) for p in trainable)
    # frozen parameters get no group
    model.bert.embeddings.word_embeddings.weight.requires_grad_(False)
    frozen = id(model.bert.embeddings.word_embeddings.weight)
    assert frozen not in {id(p) for g in _param_groups(model, cfg) for p in g["params"]}
    # the default scale keeps one learning rate for every group
    assert {g["lr"] for g in _param_groups(model, FinetuneConfig(lr=1e-3))} == {1e-3}


def test_fused_adamw_gives_the_default_loop_s_updates(tiny_base, monkeypatch):
    # the fused kernel (default, CPU too) and PyTorch's per-tensor AdamW train to the same weights
    import torch

    made = []
    adamw = torch.optim.AdamW

    def recording(*args, **kwargs):
        made.append(kwargs.get("fused"))
        return adamw(*args, **kwargs)

    monkeypatch.setattr(torch.optim, "AdamW", recording)
    ds = load_task_dataset("dair_emotion", max_train_examples=32)
    tok = load_tokenizer(tiny_base)
    common = dict(epochs=1, lr=1e-3, batch_size=8, max_length=48, max_eval_examples=8, dropout=0.0, progress=False)
    start = _build_model(tiny_base, ds, FinetuneConfig(**common))
    fused, _ = train_model(start, ds, tok, FinetuneConfig(**common))
    loop, _ = train_model(start, ds, tok, FinetuneConfig(fused_optimizer=False, **common))
    assert made == [True, None]
    sf, sl, s0 = fused.state_dict(), loop.state_dict(), start.state_dict()
    moved = max((sf[k] - s0[k]).abs().max().item() for k in sf if sf[k].is_floating_point())
    diff = max((sf[k] - sl[k]).abs().max().item() for k in sf if sf[k].is_floating_point())
    assert moved > 1e-3 and diff < 1e-5, (moved, diff)


def test_frozen_embeddings_stay_the_base_model_s_and_the_rest_trains(tiny_base, tmp_path):
    # freeze_embeddings: the token embedding table leaves training bit for bit as the base model has it (no gradient,
    # no AdamW state, no weight decay), every other weight still moves; the written checkpoint holds it unchanged
    from safetensors.torch import load_file

    common = dict(epochs=1, lr=1e-3, batch_size=8, max_length=48, max_train_examples=32, max_eval_examples=8,
                  progress=False)  # fmt: skip
    out = finetune(tiny_base, "dair_emotion", tmp_path / "frozen", FinetuneConfig(freeze_embeddings=True, **common))
    free = finetune(tiny_base, "dair_emotion", tmp_path / "free", FinetuneConfig(**common))
    base = load_file(str(tiny_base / "model.safetensors"))
    frozen, moved = load_file(str(out / "model.safetensors")), load_file(str(free / "model.safetensors"))
    word = next(k for k in base if k.endswith("word_embeddings.weight"))
    assert torch.equal(frozen["bert." + word.removeprefix("bert.")], base[word])
    assert not torch.equal(moved["bert." + word.removeprefix("bert.")], base[word])  # it does train otherwise
    body = [k for k in base if k.endswith("query.weight")]
    assert body and all(not torch.equal(frozen["bert." + k.removeprefix("bert.")], base[k]) for k in body)
    assert json.loads((out / TRAIN_REPORT).read_text())["config"]["freeze_embeddings"] is True
