"""Statistics belong to their model, and NaN / inf never reaches (or leaves) a merge."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from symfuse.errors import MissingStats, NonFiniteError, StatsMismatchError
from symfuse.match import disguise_checkpoint
from symfuse.merge import merge_checkpoints
from symfuse.stats import StatsFile, collect_stats, load_stats, save_stats, transform_stats
from tests.tiny import save_tiny_text_classifier

QUERY = "bert.encoder.layer.0.attention.self.query"


def _model(folder, seed):
    """A tiny 2-label BERT classifier with the real MiniLM tokenizer (fast, real text)."""
    return save_tiny_text_classifier(folder, seed)


def _toy_data(folder):
    folder.mkdir()
    rows = [
        {"text": f"i feel so {w} today", "label": lab}
        for w, lab in [("happy", "joy"), ("angry", "anger"), ("glad", "joy"), ("furious", "anger")] * 3
    ]
    for split in ("train", "validation", "test"):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "meta.json").write_text(json.dumps({"task": "classification", "labels": ["anger", "joy"]}))
    return folder


def _stats(model, data, out, kinds=("gram", "fisher")):
    collect_stats(model, str(data), list(kinds), out, batch_size=4, progress=False)
    return out


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    data = _toy_data(root / "toy")
    a, b = _model(root / "A", seed=0), _model(root / "B", seed=1)
    return a, b, _stats(a, data, root / "SA"), _stats(b, data, root / "SB"), data


def _bytes(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_stats_of_another_model_are_refused_naming_both(pair, tmp_path):
    a, b, sa, sb, _ = pair
    with pytest.raises(StatsMismatchError) as err:
        merge_checkpoints("regmean", [a, b], tmp_path / "o1", stats=[sa, sa])  # B's statistics are A's
    assert str(sa) in str(err.value) and str(b) in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(StatsMismatchError, match="another model"):
        merge_checkpoints("fisher", [a, b], tmp_path / "o2", stats=[sb, sa])  # swapped
    assert not [p for p in tmp_path.iterdir()]  # nothing written, no temporary folder left
    out = merge_checkpoints("regmean", [a, b], tmp_path / "ok", stats=[sa, sb])  # the right pairing still merges
    assert json.loads((out / "symfuse_report.json").read_text())["counters"]["regmean_solves"] > 0


def test_half_overwritten_stats_folder_is_refused(pair, tmp_path):
    a, b, sa, sb, _ = pair
    mixed = shutil.copytree(sa, tmp_path / "mixed")
    shutil.copy2(sb / "fisher.safetensors", mixed / "fisher.safetensors")  # gram of A, fisher of B
    with pytest.raises(StatsMismatchError, match=r"gram\.safetensors and fisher\.safetensors"):
        merge_checkpoints("regmean", [a, b], tmp_path / "o", stats=[mixed, sb])  # even if only Grams are used
    assert not (tmp_path / "o").exists()


def test_failed_stats_run_leaves_the_previous_folder_intact(pair, tmp_path, monkeypatch):
    a, _, _, _, data = pair
    out = _stats(a, data, tmp_path / "S", kinds=("gram",))
    before = _bytes(out)
    from symfuse.stats import collect

    def boom(*args, **kwargs):
        raise RuntimeError("killed while collecting the Fisher")

    monkeypatch.setattr(collect, "collect_fisher", boom)  # the Gram is done by then, the Fisher fails
    with pytest.raises(RuntimeError, match="killed"):
        collect_stats(a, str(data), ["gram", "fisher"], out, batch_size=4, progress=False)
    assert _bytes(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["S"]  # no temporary folder left


def test_transformed_stats_belong_to_the_matched_model(pair, tmp_path):
    a, b, sa, sb, _ = pair
    matched = disguise_checkpoint(a, tmp_path / "Am", seed=3, kinds=("head-permutation", "ffn-permutation"))
    moved = tmp_path / "SAm"
    moved.mkdir()
    out = transform_stats(
        sa / "gram.safetensors", matched / "transforms.safetensors", matched, moved / "gram.safetensors"
    )
    meta = StatsFile(out).meta
    assert meta["transforms_fingerprint"] and meta["source_model_fingerprint"] != meta["model_fingerprint"]
    merge_checkpoints("regmean", [matched, b], tmp_path / "ok", stats=[moved, sb])
    with pytest.raises(StatsMismatchError, match="matching"):
        merge_checkpoints("regmean", [a, b], tmp_path / "o", stats=[moved, sb])  # paired with the unmatched source
    assert not (tmp_path / "o").exists()


def _nan_copy(src, dst, name, value=float("nan")):
    shutil.copytree(src, dst)
    sd = load_file(str(dst / "model.safetensors"))
    sd[name].view(-1)[5] = value
    save_file(sd, str(dst / "model.safetensors"), {"format": "pt"})
    return dst


@pytest.mark.parametrize(
    ("strategy", "which", "value", "weights"),
    [
        ("simple", 0, float("inf"), None),
        ("simple", 1, float("inf"), None),
        ("simple", 1, float("nan"), [1.0, 0.0]),  # a model of weight 0 still carries its NaN into the sum
        ("regmean", 1, float("nan"), None),
        ("regmean", 0, float("-inf"), [0.0, 1.0]),
        ("fisher", 1, float("nan"), None),
        ("ties", 1, float("nan"), None),  # selects entries: checked on read
    ],
)
def test_nan_weights_are_refused_by_merge(pair, tmp_path, monkeypatch, strategy, which, value, weights):
    """Checked on read, or (mergers whose output carries every input) traced from the output: the file is named."""
    import symfuse.merge.checkpoints as mc

    a, b, sa, sb, _ = pair
    monkeypatch.setattr(mc, "check_stats_belong", lambda *x: None)  # the damaged copy keeps its model's statistics
    bad = _nan_copy([a, b][which], tmp_path / "bad", QUERY + ".weight", value)
    models = [bad, b] if which == 0 else [a, bad]
    extra = {"weights": weights} if weights else {}
    extra |= {"stats": [sa, sb]} if strategy in ("regmean", "fisher") else {}
    extra |= {"base": a} if strategy == "ties" else {}
    with pytest.raises(NonFiniteError) as err:
        merge_checkpoints(strategy, models, tmp_path / "o", **extra)
    assert str(bad / "model.safetensors") in str(err.value) and QUERY + ".weight" in str(err.value)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("kind", ["gram", "fisher"])
def test_nan_statistics_are_refused_before_the_solve(pair, tmp_path, kind, monkeypatch):
    a, b, sa, sb, _ = pair
    bad = shutil.copytree(sb, tmp_path / "SB")
    file = bad / f"{kind}.safetensors"
    sf = StatsFile(file)
    tensors = {k: sf.get(k) for k in sf.keys()}  # noqa: SIM118
    ffn = "bert.encoder.layer.1.intermediate.dense"  # its Gram is read (q / k / v share one Gram, read once)
    key = ffn if kind == "gram" else QUERY + ".weight"
    tensors[key][0, 0] = float("nan")
    save_stats(tensors, file, {k: v if isinstance(v, str) else json.dumps(v) for k, v in sf.meta.items()})
    solved = []
    monkeypatch.setattr(torch.linalg, "lstsq", lambda *x, **k: solved.append(1))
    with pytest.raises(NonFiniteError) as err:
        merge_checkpoints("regmean" if kind == "gram" else "fisher", [a, b], tmp_path / "o", stats=[sa, bad])
    assert str(file) in str(err.value) and key in str(err.value)
    assert not solved and not (tmp_path / "o").exists()


def test_non_finite_merged_output_is_not_written(pair, tmp_path):
    a, b, *_ = pair
    base = _model(tmp_path / "base", seed=2)
    # the fix named the strategy's own parameter: it offered --dtype, --epsilon and --alpha, which it has none of
    with pytest.raises(NonFiniteError, match=r"merged tensor .* nothing was written; try a smaller --lam, or another"):
        merge_checkpoints("task-arithmetic", [a, b], tmp_path / "o", base=base, lam=1e300)
    assert not (tmp_path / "o").exists()
    with pytest.raises(ValueError, match="epsilon"):  # 1e300 was an internal error: it does not fit float32
        merge_checkpoints("fisher", [a, b], tmp_path / "o", stats=pair[2:4], epsilon=1e300)


def _fisher_copy(sb, folder, change, kind="fisher"):
    """A copy of ``sb`` whose ``kind`` file holds ``change(tensors)`` (the metadata kept: it still names B)."""
    bad = shutil.copytree(sb, folder)
    file = bad / f"{kind}.safetensors"
    sf = StatsFile(file)
    tensors = change({k: sf.get(k) for k in sf.keys()})  # noqa: SIM118
    save_stats(tensors, file, {k: v if isinstance(v, str) else json.dumps(v) for k, v in sf.meta.items()})
    return bad, file


def test_a_gram_with_a_negative_diagonal_is_refused_naming_the_file(pair, tmp_path):
    """A negated Gram made RegMean's system indefinite: solved by lstsq with a warning naming no file, exit 0."""
    a, b, sa, sb, _ = pair
    module = "bert.encoder.layer.0.intermediate.dense"
    bad, file = _fisher_copy(sb, tmp_path / "SB", lambda t: {**t, module: -t[module]}, kind="gram")
    with pytest.raises(StatsMismatchError) as err:
        merge_checkpoints("regmean", [a, b], tmp_path / "o", stats=[sa, bad])
    assert str(err.value).startswith(f"{file}: the Gram of {module} has a negative diagonal entry"), err.value
    assert not (tmp_path / "o").exists()
    # a zeroed one (its metadata still counting the tokens read) merged with exit 0: the model had no say there
    zero, file = _fisher_copy(sb, tmp_path / "Z", lambda t: {k: torch.zeros_like(v) for k, v in t.items()}, "gram")
    with pytest.raises(StatsMismatchError, match=rf"^{file}: the Gram of .* is zero: no input reached the layer"):
        merge_checkpoints("regmean", [a, b], tmp_path / "o", stats=[sa, zero])
    assert not (tmp_path / "o").exists()

    # one slightly negative entry left the summed system positive definite: RegMean's CPU path did not look
    def dent(t):
        g = t[module].clone()
        g[0, 0] = -1e-6
        return {**t, module: g}

    dented, file = _fisher_copy(sb, tmp_path / "D", dent, "gram")
    with pytest.raises(StatsMismatchError, match=rf"^{file}: the Gram of {module} has a negative diagonal entry"):
        merge_checkpoints("regmean", [a, b], tmp_path / "o", stats=[sa, dented])
    assert not (tmp_path / "o").exists()


def test_a_gram_missing_or_of_another_size_is_refused_naming_the_file(pair, tmp_path):
    """Both named no file: "missing from some models' statistics", "Grams must be square and of one size"."""
    a, b, sa, sb, _ = pair
    module = "bert.encoder.layer.0.intermediate.dense"
    cases = [
        (lambda t: {k: v for k, v in t.items() if k != module}, f"no Gram of {module}, which the other models'"),
        (lambda t: {**t, module: t[module][:-1, :-1]}, f"the Gram of {module} has shape [31, 31], but the layer"),
    ]
    for i, (change, words) in enumerate(cases):
        bad, file = _fisher_copy(sb, tmp_path / f"SB{i}", change, kind="gram")
        with pytest.raises((MissingStats, StatsMismatchError)) as err:
            merge_checkpoints("regmean", [a, b], tmp_path / "o", stats=[sa, bad])
        assert str(err.value).startswith(f"{file}: {words}"), err.value
        assert "symfuse stats MODEL --data DATA --kind gram" in str(err.value)
        assert not (tmp_path / "o").exists()


def test_a_fisher_that_does_not_fit_its_model_is_refused(pair, tmp_path, caplog):
    """Negative entries, another shape, no tensor of the model: each refused in one line naming the file."""
    a, b, sa, sb, _ = pair
    key = QUERY + ".weight"

    def negative(t):
        t[key][0, 0] = -0.5
        return t

    def other_shape(t):
        t[key] = torch.zeros(t[key].shape[0] + 1, t[key].shape[1])
        return t

    cases = [(negative, "negative entries"), (other_shape, f"the Fisher of {key} has shape"),
             (lambda t: {"foo.weight": torch.ones(3)}, "names none of"),
             # all zero: merged with exit 0, the model's weight floored at epsilon everywhere (B's tensors ignored)
             (lambda t: {k: torch.zeros_like(v) for k, v in t.items()}, "every Fisher entry is zero")]  # fmt: skip
    for i, (change, words) in enumerate(cases):
        bad, file = _fisher_copy(sb, tmp_path / f"SB{i}", change)
        with pytest.raises(StatsMismatchError) as err:
            merge_checkpoints("fisher", [a, b], tmp_path / "o", stats=[sa, bad])
        assert str(file) in str(err.value) and words in str(err.value) and "\n" not in str(err.value), err.value
        assert not (tmp_path / "o").exists()
    # a Fisher of a few tensors merges, and says how many it leaves to the plain average; a zero tensor is allowed
    part, _ = _fisher_copy(sb, tmp_path / "part", lambda t: {key: t[key], "classifier.bias": t["classifier.bias"] * 0})
    with caplog.at_level("WARNING"):
        merge_checkpoints("fisher", [a, b], tmp_path / "ok", stats=[sa, part])
    assert any("no Fisher for" in r.getMessage() and str(part) in r.getMessage() for r in caplog.records)


def test_a_renamed_or_cut_stats_file_is_named_with_the_stats_fix(pair, tmp_path):
    """A Fisher file named gram.safetensors was "no Gram of <module>, which the other models' statistics hold"; a stats
    file cut in half was told to "re-export the file (save_pretrained with safe_serialization)"."""
    a, b, sa, sb, _ = pair
    renamed = shutil.copytree(sb, tmp_path / "R")
    (renamed / "gram.safetensors").unlink()
    (renamed / "fisher.safetensors").rename(renamed / "gram.safetensors")
    with pytest.raises(StatsMismatchError, match=rf"^{renamed}/gram.safetensors: holds fisher statistics \(its "
                                                 r"metadata\), not gram — name it fisher.safetensors"):  # fmt: skip
        merge_checkpoints("regmean", [a, b], tmp_path / "o", stats=[sa, renamed])
    cut = shutil.copytree(sb, tmp_path / "C")
    data = (cut / "gram.safetensors").read_bytes()
    (cut / "gram.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(StatsMismatchError, match=rf"^{cut}/gram.safetensors: .* — recollect it: symfuse stats MODEL"):
        merge_checkpoints("regmean", [a, b], tmp_path / "o", stats=[sa, cut])
    assert not (tmp_path / "o").exists()


def _resharded(model, out, touch=None):
    """``model``'s tensors in two shards with an index, its config re-saved by another writer (same function)."""
    out = shutil.copytree(model, out)
    (out / "model.safetensors").unlink()
    state = load_file(model / "model.safetensors")
    if touch:
        state[touch] = state[touch].clone()
        state[touch].view(-1)[0] += 1e-3
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in halves.items():
        save_file({n: state[n] for n in part}, out / file, {"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: f for f, part in halves.items() for n in part}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((model / "config.json").read_text())
    config = {"transformers_version": "9.9.9", **dict(reversed(list(config.items())))}
    (out / "config.json").write_text(json.dumps(config, indent=4))
    return out


def test_stats_follow_the_model_across_a_reshard_and_refuse_a_changed_tensor(pair, tmp_path):
    # the fingerprint hashes what the model computes with (config, tensors), not how its files are laid out
    a, b, sa, sb, _ = pair
    plain = merge_checkpoints("regmean", [a, b], tmp_path / "plain", stats=[sa, sb])
    moved = merge_checkpoints("regmean", [_resharded(a, tmp_path / "A2"), b], tmp_path / "moved", stats=[sa, sb])
    want, got = load_file(plain / "model.safetensors"), load_file(moved / "model.safetensors")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    touched = _resharded(a, tmp_path / "A3", touch=f"{QUERY}.weight")
    with pytest.raises(StatsMismatchError, match="collected on another model"):
        merge_checkpoints("regmean", [touched, b], tmp_path / "o", stats=[sa, sb])


def test_stats_written_with_the_older_file_fingerprint_are_still_checked(pair, tmp_path):
    from symfuse.stats import files_fingerprint

    a, b, sa, sb, _ = pair
    old = tmp_path / "old"
    old.mkdir()
    for f in sa.iterdir():
        tensors, meta = load_stats(f)
        save_stats(tensors, old / f.name, {**meta, "model_fingerprint": files_fingerprint(a)})
    merge_checkpoints("regmean", [a, b], tmp_path / "ok", stats=[old, sb])
    with pytest.raises(StatsMismatchError, match="collected on another model"):
        merge_checkpoints("regmean", [b, a], tmp_path / "o", stats=[old, sa])
