"""residual-orthogonal from weights: a disguise by a random stream map (and module maps) is found again, exactly."""

import json

import pytest
import torch
from safetensors.torch import load_file

from symfuse.match import align_checkpoints, disguise_checkpoint, match_checkpoints
from symfuse.match.output_check import full_logit_diff
from tests.cli.helpers import run_cli
from tests.tiny import save_tiny

KINDS = ["ffn-permutation", "head-permutation", "rotation", "scaling"]


@pytest.mark.parametrize(
    ("family", "head", "tied"),
    [("gpt2", "lm", True), ("llama", "lm", False), ("llama", "lm", True), ("gpt2", "seq", True)],
)
def test_disguise_and_match_back(tmp_path, family, head, tied):
    """A tied Llama's disguise is untied (the stream map moves its final norm into the head): matched back onto the
    tied anchor it was a KeyError on 'lm_head.weight'."""
    anchor = save_tiny(tmp_path / "a", family, seed=1, head=head, pad_token_id=0, tie_word_embeddings=tied)
    src = disguise_checkpoint(anchor, tmp_path / "d", seed=4, kinds=["residual-orthogonal", *KINDS])
    diff, scale = full_logit_diff(src, anchor)
    assert diff <= 1e-4 * scale  # the disguise computes the anchor's function
    report = align_checkpoints(src, anchor, tmp_path / "m", ["residual-orthogonal", *KINDS], device="cpu")
    assert report["exact"] is True and report["max_abs_logit_diff"] <= 1e-4
    assert report["distance_after"] <= 1e-4 * report["distance_before"]  # the planted map is recovered
    got, want = load_file(str(tmp_path / "m" / "model.safetensors")), load_file(str(anchor / "model.safetensors"))
    for name, t in want.items():  # the anchor's own weights and norms, in the anchor's parametrisation
        torch.testing.assert_close(got[name], t, rtol=0, atol=1e-4)
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["architectures"] == json.loads((anchor / "config.json").read_text())["architectures"]


def test_the_weights_driver_leaves_the_whole_stream_to_align_checkpoints(tmp_path):
    anchor = save_tiny(tmp_path / "a", "gpt2", seed=1, head="lm", pad_token_id=0)
    with pytest.raises(ValueError, match="residual-orthogonal maps the whole stream at once"):
        match_checkpoints(anchor, anchor, tmp_path / "m", ["residual-orthogonal", *KINDS])
    assert not (tmp_path / "m").exists()


def test_cli_and_post_ln_refusal(tmp_path):
    a = save_tiny(tmp_path / "a", "llama", seed=1, head="lm", pad_token_id=0)
    b = save_tiny(tmp_path / "b", "llama", seed=2, head="lm", pad_token_id=0)  # an independent init
    proc = run_cli("match", b, a, "--out", tmp_path / "m", "--symmetries", "residual-orthogonal,ffn-permutation",
                   "--device", "cpu")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "m" / "symfuse_report.json").read_text())
    assert report["exact"] and report["distance_after"] < report["distance_before"]
    assert report["history"] == sorted(report["history"], reverse=True)  # the distance never rises
    bert = save_tiny(tmp_path / "bert", "bert", seed=1)
    proc = run_cli("match", bert, bert, "--out", tmp_path / "x", "--symmetries", "residual-orthogonal")
    assert proc.returncode == 1 and not (tmp_path / "x").exists()
    assert proc.stderr.strip().splitlines()[-1].startswith("error: bert: an orthogonal map of the residual stream")


def test_a_norm_holding_nan_is_refused_naming_the_file_and_tensor(tmp_path):
    """Only this driver read norms unchecked: linalg.svd's "failed to converge" (internal error) or a KeyError."""
    from safetensors.torch import save_file

    a = save_tiny(tmp_path / "a", "llama", seed=1, head="lm", pad_token_id=0)
    b = save_tiny(tmp_path / "b", "llama", seed=2, head="lm", pad_token_id=0)
    weights = load_file(str(b / "model.safetensors"))
    weights["model.layers.0.input_layernorm.weight"][0] = float("nan")
    save_file(weights, str(b / "model.safetensors"), metadata={"format": "pt"})
    for command in ("match", "match-many"):
        proc = run_cli(command, b, a, "--out", tmp_path / "m", "--symmetries", "residual-orthogonal", "--device", "cpu")
        assert proc.returncode == 1 and not (tmp_path / "m").exists(), proc.stderr
        assert proc.stderr.strip().splitlines()[-1] == (
            f"error: {b}: tensor 'model.layers.0.input_layernorm.weight' holds 1 NaN / inf value(s) — the file is "
            "corrupt or training diverged; use another checkpoint or re-export it"
        )


def _gpt2_classifier(folder, seed):
    import transformers as T

    from symfuse.checkpoint import resolve_checkpoint
    from tests.tiny import tiny_config

    tok = T.AutoTokenizer.from_pretrained(str(resolve_checkpoint("minilm")))
    cfg = tiny_config("gpt2", vocab_size=tok.vocab_size, num_labels=7, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    T.GPT2ForSequenceClassification(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_cli_refinement_on_data_stays_exact(tmp_path):
    a, b = _gpt2_classifier(tmp_path / "a", 1), _gpt2_classifier(tmp_path / "b", 2)
    args = ("--symmetries", "residual-orthogonal,ffn-permutation", "--data", "meld", "--max-examples", "32")
    proc = run_cli("match", b, a, "--out", tmp_path / "m", *args, "--refine", "5", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "m" / "symfuse_report.json").read_text())
    assert report["exact"] is True and report["refine"]["steps"] == 5 and report["init"] == "activations"
    proc = run_cli("match", b, a, "--out", tmp_path / "n", "--symmetries", "ffn-permutation", "--refine", "5")
    assert proc.returncode == 2 and "--refine: refines residual-orthogonal's map on data" in proc.stderr


def _named(folder, seed, names, rows=None):
    """A GPT-2 classifier over ``names``; ``rows``: its head's rows reordered (with the names) to that order."""
    import transformers as T

    folder = _gpt2_classifier(folder, seed)
    model = T.AutoModelForSequenceClassification.from_pretrained(folder)
    if rows is not None:
        with torch.no_grad():
            model.score.weight.copy_(model.score.weight[rows].clone())
        names = [names[i] for i in rows]
    model.config.id2label, model.config.label2id = dict(enumerate(names)), {n: i for i, n in enumerate(names)}
    model.save_pretrained(folder)
    return folder


def test_refinement_reads_targets_by_class_name_and_refuses_two_label_spaces(tmp_path):
    from symfuse.data import load_task_dataset
    from symfuse.errors import CheckpointError

    data = list(load_task_dataset("meld").labels)
    names = data[::-1]
    order = [names.index(c) for c in data]  # the reversed heads' rows in the dataset's order
    kinds = ["residual-orthogonal", "ffn-permutation"]
    last = {}
    for tag, rows in (("reversed", None), ("dataset-order", order)):  # one pair of functions, two head orders
        a, b = _named(tmp_path / f"a-{tag}", 1, names, rows), _named(tmp_path / f"b-{tag}", 2, names, rows)
        report = align_checkpoints(b, a, tmp_path / f"m-{tag}", kinds, "meld", max_examples=32, refine=4,
                                   device="cpu")  # fmt: skip
        last[tag] = report["refine"]["last_loss"]
    assert last["reversed"] == pytest.approx(last["dataset-order"], rel=1e-6), last
    with pytest.raises(CheckpointError, match="their heads name their classes differently"):
        align_checkpoints(tmp_path / "b-reversed", tmp_path / "a-dataset-order", tmp_path / "o", kinds, "meld",
                          max_examples=32, refine=4, device="cpu")  # fmt: skip
    assert not (tmp_path / "o").exists()


def test_statistics_do_not_follow_a_stream_map_they_are_recollected(tmp_path):
    from symfuse.stats import transform_stats
    from symfuse.stats.io import save_stats

    a = save_tiny(tmp_path / "a", "gpt2", seed=1, head="lm", pad_token_id=0)
    b = save_tiny(tmp_path / "b", "gpt2", seed=2, head="lm", pad_token_id=0)
    out = tmp_path / "m"
    align_checkpoints(b, a, out, ["residual-orthogonal", *KINDS])
    name = "transformer.h.0.mlp.c_fc.weight"  # a module input's Gram, in B's basis: no per-module part maps it
    d = load_file(str(b / "model.safetensors"))[name].shape[0]
    stats = save_stats({name: torch.eye(d)}, tmp_path / "gram.safetensors", {"kind": "gram", "n": 1})
    assert transform_stats(stats, out / "transforms.safetensors", out, tmp_path / "t.safetensors") is None
    assert not (tmp_path / "t.safetensors").exists()
