"""Statistics follow matching: transformed stats == stats recollected on the transformed model."""

import pytest
import torch
import transformers

from symfuse.checkpoint import CheckpointReader, write_checkpoint
from symfuse.stats import StatsFile, collect_fisher, collect_gram, save_stats, transform_stats
from symfuse.symmetry import ALL_KINDS, random_module_transform, save_transforms
from tests.tiny import random_inputs, save_tiny

EXACT_FOR_FISHER = ("ffn-permutation", "head-permutation", "scaling")


def _transformed_checkpoint(src, out, kinds, seed=0):
    reader = CheckpointReader(src)
    g = torch.Generator().manual_seed(seed)
    mts = {ref.key: random_module_transform(ref, reader.geometry, g, kinds) for ref in reader.modules()}
    replace = {}
    for ref in reader.modules():
        new = mts[ref.key].apply(reader.read_module(ref))
        replace.update(reader.spec.write_module(new, ref, reader.config, reader.prefix))
    write_checkpoint(reader, out, replace={k: v.float() for k, v in replace.items()})
    return out, save_transforms(mts, out.parent / f"{out.name}-transforms.safetensors")


def _load(folder):
    return transformers.AutoModelForSequenceClassification.from_pretrained(str(folder)).eval()


def _batches(model):
    out = []
    for s in range(2):
        b = random_inputs(model, batch=4, seq=7, seed=s)
        b["labels"] = torch.tensor([0, 1, 2, s])
        out.append(b)
    return out


@pytest.mark.parametrize("kinds", [ALL_KINDS, ("head-linear", "head-permutation", "ffn-permutation")])
@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_transformed_gram_equals_gram_recollected_on_matched_model(tmp_path, family, kinds):
    src = save_tiny(tmp_path / "src", family, seed=0, head="seq", pad_token_id=0)
    matched, tfile = _transformed_checkpoint(src, tmp_path / "matched", kinds)
    m_src, m_new = _load(src), _load(matched)
    batches = _batches(m_src)
    g_src = collect_gram(m_src, batches, progress=False)
    save_stats(g_src.grams, tmp_path / "gram.safetensors", {"kind": "gram", "conv1d": g_src.conv1d})
    out = transform_stats(tmp_path / "gram.safetensors", tfile, src, tmp_path / "gram_t.safetensors")
    assert out is not None
    moved = StatsFile(out)
    recollected = collect_gram(m_new, batches, progress=False).grams
    changed = 0
    for key, g in recollected.items():
        torch.testing.assert_close(moved.get(key), g, rtol=1e-4, atol=1e-6, msg=key)
        changed += not torch.allclose(g_src.grams[key], g, rtol=1e-4, atol=1e-6)
    assert changed >= 2  # the o / down inputs really changed basis


def test_fisher_follows_permutations_and_scalings(tmp_path):
    src = save_tiny(tmp_path / "src", "bert", seed=0, head="seq")
    matched, tfile = _transformed_checkpoint(src, tmp_path / "matched", EXACT_FOR_FISHER, seed=1)
    m_src, m_new = _load(src), _load(matched)
    batches = _batches(m_src)
    f_src = collect_fisher(m_src, batches, progress=False).fisher
    save_stats(f_src, tmp_path / "fisher.safetensors", {"kind": "fisher"})
    out = transform_stats(tmp_path / "fisher.safetensors", tfile, src, tmp_path / "fisher_t.safetensors")
    assert out is not None
    moved = StatsFile(out)
    recollected = collect_fisher(m_new, batches, progress=False).fisher
    for key, f in recollected.items():
        torch.testing.assert_close(moved.get(key).double(), f, rtol=2e-3, atol=1e-9, msg=key)
    key = "bert.encoder.layer.0.output.dense.weight"
    assert not torch.allclose(f_src[key], recollected[key], rtol=1e-3)


@pytest.mark.parametrize("kind", ["rotation", "head-linear"])
def test_fisher_under_rotation_is_not_transformed_but_recollected(tmp_path, kind):
    src = save_tiny(tmp_path / "src", "bert", seed=0, head="seq")
    _, tfile = _transformed_checkpoint(src, tmp_path / "matched", (kind,), seed=2)
    f = collect_fisher(_load(src), _batches(_load(src))[:1], progress=False).fisher
    save_stats(f, tmp_path / "fisher.safetensors", {"kind": "fisher"})
    assert transform_stats(tmp_path / "fisher.safetensors", tfile, src, tmp_path / "f_t.safetensors") is None
    assert not (tmp_path / "f_t.safetensors").exists()
