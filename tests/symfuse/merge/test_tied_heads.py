"""A model that ties its LM head to the embedding merges with one that stores its own (e.g. after residual-orthogonal
alignment): the tied head is read as the embedding, and the merge stores its head untied."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from symfuse.match.align import align_checkpoints
from symfuse.merge import merge_checkpoints
from tests.tiny import tiny_model


def _gpt2(folder, seed):
    m = tiny_model("gpt2", seed=seed, head="lm", pad_token_id=0)
    with torch.no_grad():  # trained models' norms are not ones: aligning them unties the head
        for n, p in m.named_parameters():
            if ".ln_" in n:
                p.add_(0.3 * torch.randn_like(p))
    m.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("tied")
    a, b = _gpt2(root / "a", 0), _gpt2(root / "b", 1)
    align_checkpoints(b, a, root / "b-aligned", ["residual-orthogonal", "ffn-permutation"])
    return a, root / "b-aligned"


@pytest.mark.parametrize("order", ["tied-first", "untied-first"])
def test_a_tied_and_an_untied_head_merge_into_an_untied_head(pair, tmp_path, order):
    a, b = pair
    assert json.loads((a / "config.json").read_text()).get("tie_word_embeddings", True)
    assert json.loads((b / "config.json").read_text())["tie_word_embeddings"] is False
    models = [a, b] if order == "tied-first" else [b, a]
    out = merge_checkpoints("simple", models, tmp_path / "m")
    wa, wb, got = (load_file(str(f / "model.safetensors")) for f in (a, b, out))
    want = (wa["transformer.wte.weight"].double() + wb["lm_head.weight"].double()) / 2
    torch.testing.assert_close(got["lm_head.weight"].double(), want)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    model = AutoModelForCausalLM.from_pretrained(out)  # the same class loads it, with its own head
    torch.testing.assert_close(model.lm_head.weight.detach().double(), want)
    assert not torch.equal(model.lm_head.weight, model.transformer.wte.weight)


def test_a_tied_base_gives_its_head_to_task_arithmetic(pair, tmp_path):
    a, b = pair
    out = merge_checkpoints("task-arithmetic", [b, b], tmp_path / "ta", base=a, lam=0.25)  # base + (b - base) / 2
    wa, wb, got = (load_file(str(f / "model.safetensors")) for f in (a, b, out))
    want = (wa["transformer.wte.weight"] + wb["lm_head.weight"]) / 2  # base + (b - base) / 2, base's head tied
    torch.testing.assert_close(got["lm_head.weight"], want)
