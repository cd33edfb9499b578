"""Bad inputs to every command: one clean line, the right exit status, nothing written (issue 13).

Each case runs ``python -m symfuse.cli`` as a subprocess and checks: the exit status (2 usage, 1 data), at most
three non-empty lines on stderr and none of them a traceback, the offending artifact named, nothing created next to
``--out`` (no output, temp folder or lock left), and a pre-existing ``--out`` left byte for byte. Some cases run
again with ``-v`` (at the end of the command line), which must add the traceback and keep the status.
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from symfuse.stats.io import save_stats
from tests.cli.helpers import listing, run_cli, toy_dataset
from tests.gguf_tiny import tiny_llama, write_gguf
from tests.tiny import nan_copy, save_tiny, save_tiny_text_classifier


@dataclass(frozen=True)
class Case:
    id: str
    args: tuple[str, ...]  # placeholders {NAME} are input paths; {OUT} is the case's --out
    code: int
    expect: str  # must appear in the error line (the artifact: option, file or folder name)
    pre: str | None = None  # "dir" / "file": --out exists before the run
    verbose: bool = False  # also run with -v: the traceback must appear


def C(id: str, args: str, code: int, expect: str, pre: str | None = None, verbose: bool = False) -> Case:
    return Case(id, tuple(args.split()), code, expect, pre, verbose)


OUT = "--out {OUT}"
SECRET = "testSECRETvalue99"
MERGE = "merge --strategy"
CASES = [
    # --- merge ---
    C("merge-unknown-strategy", f"{MERGE} nosuch --models {{A}} {{B}} {OUT}", 2, "nosuch", verbose=True),
    C("merge-density-above-1", f"{MERGE} ties --base {{A}} --density 1.5 --models {{A}} {{B}} {OUT}", 2, "--density"),
    C("merge-density-zero", f"{MERGE} ties --base {{A}} --density 0 --models {{A}} {{B}} {OUT}", 2, "--density"),
    C(
        "merge-align-data-alone",
        f"{MERGE} simple --models {{A}} {{B}} --align-data {{DATA}} {OUT}",
        2,
        "--align-data: given without --align",
    ),  # ignored: the unaligned merge, exit 0
    C("merge-drop-one", f"{MERGE} dare --base {{A}} --drop 1 --models {{A}} {{B}} {OUT}", 2, "--drop"),
    C(
        "merge-alpha-negative",
        f"{MERGE} regmean --alpha -0.5 --models {{A}} {{B}} --stats {{GS}} {{GS}} {OUT}",
        2,
        "--alpha",
    ),
    C("merge-weights-count", f"{MERGE} simple --models {{A}} {{B}} --weights 1 {OUT}", 2, "--weights", verbose=True),
    C("merge-weights-negative", f"{MERGE} simple --models {{A}} {{B}} --weights 1 -2 {OUT}", 2, "--weights"),
    C("merge-weights-not-a-number", f"{MERGE} simple --models {{A}} {{B}} --weights 1 x {OUT}", 2, "--weights"),
    C("merge-one-model", f"{MERGE} simple --models {{A}} {OUT}", 2, "--models"),
    C("merge-no-models", f"{MERGE} simple {OUT}", 2, "--models"),
    C("merge-missing-model", f"{MERGE} simple --models {{A}} {{MISSING}} {OUT}", 2, "missing"),
    C("merge-tensor-missing", f"{MERGE} simple --models {{A}} {{NOLAYER}} {OUT}", 1, "nolayer: checkpoint does not"),
    C("merge-link-loop", f"{MERGE} simple --models {{A}} {{LOOP}} {OUT}", 2, "symbolic link that leads nowhere"),
    C("merge-other-architecture", f"{MERGE} simple --models {{A}} {{ROBERTA}} {OUT}", 1, "a roberta model, and"),
    C("merge-model-url", f"{MERGE} simple --models s3://bucket/model {{B}} {OUT}", 2, "s3://bucket/model is a URL"),
    C("merge-model-is-a-file", f"{MERGE} simple --models {{A}} {{FILE}} {OUT}", 2, "notes.txt"),
    C("merge-empty-folder", f"{MERGE} simple --models {{A}} {{EMPTY}} {OUT}", 1, "empty"),
    C("merge-garbage-weights", f"{MERGE} simple --models {{A}} {{GARBAGE}} {OUT}", 1, "garbage", verbose=True),
    C("merge-truncated-weights", f"{MERGE} simple --models {{A}} {{TRUNC}} {OUT}", 1, "trunc"),
    C("merge-garbage-config", f"{MERGE} simple --models {{A}} {{BADCONF}} {OUT}", 1, "badconf"),
    C("merge-different-shapes", f"{MERGE} simple --models {{A}} {{WIDE}} {OUT}", 1, "wide"),
    C("merge-stats-count", f"{MERGE} regmean --models {{A}} {{B}} --stats {{GS}} {OUT}", 2, "--stats"),
    C("merge-stats-absent", f"{MERGE} fisher --models {{A}} {{B}} {OUT}", 2, "--stats"),
    C(
        "merge-stats-garbage",
        f"{MERGE} regmean --models {{A}} {{B}} --stats {{GS}} {{GS}} {OUT}",
        1,
        "gram.safetensors",
    ),
    C(
        "merge-stats-wrong-kind-files",
        f"{MERGE} fisher --models {{A}} {{B}} --stats {{GRAMS}}/gram.safetensors {{GRAMS}}/gram.safetensors {OUT}",
        2,
        "grams/gram.safetensors (gram): not fisher statistics",
    ),
    C(
        "merge-stats-wrong-kind-folder",
        f"{MERGE} fisher --models {{A}} {{B}} --stats {{GRAMS}} {{GRAMS}} {OUT}",
        2,
        "grams holds gram statistics, not fisher",
    ),
    C(
        "merge-refit-data-of-other-classes",
        f"{MERGE} simple --models {{CA}} {{CB}} --refit-heads --data {{DATA}} {{BIG}} {OUT}",
        2,
        "big (for {CB}) has 4 classes for a head of 2 unnamed outputs — give each model the data its head was",
        verbose=True,
    ),
    C(
        "merge-regmean++-data-sharing-no-class",
        f"{MERGE} regmean++ --models {{CN}} {{CB}} --data {{DATA}} {{DATA}} {OUT}",
        2,
        "toy (for {CN}) shares no class with the head (red, blue); its classes: anger, joy — give each model",
    ),
    C(
        "merge-misspelt-model-type",
        f"{MERGE} simple --models {{A}} {{MISSPELT}} {OUT}",
        1,
        "misspelt/config.json: model_type 'bret' is not an architecture symfuse knows — did you mean 'bert'? fix "
        "model_type, or use a model of a known family (albert, bert, ",
    ),
    C(
        "merge-config-yaml-syntax",
        f"merge --config {{SYNTAX}} {OUT}",
        2,
        "syntax.yaml: not valid YAML at line 3, column 7 (expected ',' or ']', but got ':') — fix the syntax",
    ),
    C("merge-model-twice", f"{MERGE} simple --models {{A}} {{B}} {{A}}/ {OUT}", 2, "given twice (as {A} and {A}/)"),
    C("merge-base-not-used", f"{MERGE} simple --base {{A}} --models {{A}} {{B}} {OUT}", 2, "--base"),
    C("merge-base-among-models", f"{MERGE} ties --base {{A}}/ --models {{A}} {{B}} {OUT}", 2, "is among --models too"),
    C("merge-base-missing", f"{MERGE} ties --models {{A}} {{B}} {OUT}", 2, "--base"),
    C("merge-option-not-used", f"{MERGE} simple --alpha 0.5 --models {{A}} {{B}} {OUT}", 2, "--alpha"),
    C("merge-unknown-option", f"{MERGE} simple --models {{A}} {{B}} --bogus 1 {OUT}", 2, "--bogus"),
    C("merge-out-exists", f"{MERGE} simple --models {{A}} {{B}} {OUT}", 2, "{OUT}", pre="dir"),
    C("merge-out-is-a-file", f"{MERGE} simple --models {{A}} {{B}} {OUT} --overwrite", 2, "{OUT}", pre="file"),
    C("merge-config-missing", f"merge --config {{MISSING}}.yaml {OUT}", 2, "missing.yaml"),
    C("merge-config-unknown-key", f"merge --config {{BADYAML}} {OUT}", 2, "modles", verbose=True),
    C("merge-config-and-flags", f"merge --config {{BADYAML}} {OUT} --strategy simple", 2, "--strategy"),
    # --- merge-lora ---
    C("merge-lora-not-an-adapter", f"merge-lora --adapters {{A}} {OUT}", 2, "not a PEFT adapter folder"),
    C("merge-lora-missing-adapter", f"merge-lora --adapters {{MISSING}} {OUT}", 2, "missing", verbose=True),
    C("merge-lora-adapter-twice", f"merge-lora --adapters {{A}} {{A}} {OUT}", 2, "--adapters: {A} given twice — "),
    C("merge-lora-unknown-basis", f"merge-lora --adapters {{A}} --basis wrong {OUT}", 2, "--basis"),
    # --- match ---
    C("match-empty-symmetries", f"match {{A}} {{B}} {OUT} --symmetries ,", 2, "--symmetries", verbose=True),
    C("match-unknown-symmetry", f"match {{A}} {{B}} {OUT} --symmetries rotation,bogus", 2, "bogus"),
    C("match-residual-without-data", f"match {{A}} {{B}} {OUT} --symmetries residual-permutation", 2, "--data"),
    C("match-max-examples-zero", f"match {{A}} {{B}} {OUT} --data {{DATA}} --max-examples 0", 2, "--max-examples"),
    C("match-workers-zero", f"match {{A}} {{B}} {OUT} --workers 0", 2, "--workers"),
    C("match-refine-huge", f"match {{A}} {{B}} {OUT} --refine 1000000000000", 2, "--refine: 1000000000000 is above"),
    C("match-missing-source", f"match {{MISSING}} {{B}} {OUT}", 2, "missing"),
    C("match-adapter-source", f"match {{ADAPTER}} {{B}} {OUT}", 1, "a PEFT adapter (adapter_config.json), not a model"),
    C("match-family-mismatch", f"match {{A}} {{GPT}} {OUT}", 1, "gpt"),
    C("match-nan-anchor", f"match {{A}} {{NAN}} {OUT}", 1, "NaN"),
    C("match-garbage-anchor", f"match {{A}} {{GARBAGE}} {OUT}", 1, "garbage"),
    C("match-unknown-dataset", f"match {{A}} {{B}} {OUT} --data nosuch_dataset", 1, "nosuch_dataset"),
    C("match-out-exists", f"match {{A}} {{B}} {OUT}", 2, "{OUT}", pre="dir", verbose=True),
    # --- match-many ---
    C("match-many-no-models", f"match-many {OUT}", 2, "M1 M2"),
    C("match-many-one-model", f"match-many {{A}} {OUT}", 2, "M1 M2", verbose=True),
    C("match-many-unknown-anchor", f"match-many {{A}} {{B}} {OUT} --anchor nosuch", 2, "nosuch"),
    C("match-many-model-twice", f"match-many {{A}} {{B}} {{A}}/ {OUT}", 2, "given twice (as {A} and {A}/) — give"),
    C("inspect-split-without-data", "inspect {A} {B} --split validation", 2, "--split: only read with --data"),
    C("inspect-residual-iters-post-ln", "inspect {A} {B} --residual-iters 5", 2, "--residual-iters: bert models"),
    C("inspect-out-not-png", "inspect {A} {B} --out {OUT}.pdf", 2, "draws a PNG image; name the file .png"),
    C(
        "match-many-activations-only-symmetry",
        f"match-many {{A}} {{B}} {OUT} --symmetries rotation,residual-permutation",
        2,
        "--symmetries: residual-permutation is not available for match-many: it is found from activations",
    ),
    C("match-many-unknown-symmetry", f"match-many {{A}} {{B}} {OUT} --symmetries rotation,bogus", 2, "bogus"),
    C("match-many-tol-inf", f"match-many {{A}} {{B}} {OUT} --tol inf", 2, "--tol: inf is not a finite number"),
    C("match-many-max-iter-zero", f"match-many {{A}} {{B}} {OUT} --anchor barycenter --max-iter 0", 2, "--max-iter"),
    C("match-many-missing-model", f"match-many {{A}} {{B}} {{MISSING}} {OUT}", 2, "missing"),
    C("match-many-family-mismatch", f"match-many {{A}} {{B}} {{GPT}} {OUT}", 1, "gpt"),
    C("match-many-garbage-model", f"match-many {{A}} {{GARBAGE}} {OUT}", 1, "garbage"),
    C("match-many-out-exists", f"match-many {{A}} {{B}} {OUT}", 2, "{OUT}", pre="dir"),
    # --- disguise ---
    C("disguise-unknown-kind", f"disguise {{A}} {OUT} --kinds rotation,bogus", 2, "bogus"),
    C("disguise-empty-kinds", f"disguise {{A}} {OUT} --kinds ,", 2, "--kinds"),
    C("disguise-negative-noise", f"disguise {{A}} {OUT} --noise -1", 2, "--noise"),
    C("disguise-huge-noise", f"disguise {{A}} {OUT} --noise 1e40", 2, "--noise: 1e+40 is above 100"),  # inf weights
    C("disguise-seed-not-an-int", f"disguise {{A}} {OUT} --seed x", 2, "--seed"),
    C("disguise-missing-source", f"disguise {{MISSING}} {OUT}", 2, "missing"),
    C("disguise-empty-folder", f"disguise {{EMPTY}} {OUT}", 1, "empty"),
    C("disguise-out-exists", f"disguise {{A}} {OUT}", 2, "{OUT}", pre="dir"),
    # --- stats ---
    # --- drop (validated before the store is opened: --store {OUT} is never created) ---
    C("drop-missing-checkpoint", "drop {MISSING} --run r1 --store {OUT}", 2, "missing"),
    C("drop-nan-checkpoint", "drop {NAN} --run r1 --store {OUT}", 1, "nan", verbose=True),
    C("drop-bad-run-id", "drop {A} --run ../r1 --store {OUT}", 2, "run id"),
    # a credential inside the store URL: refused, masked, also in -v's traceback (it was printed seven times)
    C(
        "drop-store-credentials",
        f"drop {{A}} --run r1 --store s3://AKIATESTKEY0000:{SECRET}@b/p",
        2,
        "--store s3://[REDACTED]@b/p: credentials in the URL are not read",
        verbose=True,
    ),
    C("drop-store-unknown-scheme", "drop {A} --run r1 --store foo://b/p", 2, "unknown storage scheme 'foo'"),
    # click took the next option as the value: a folder named --overwrite was written, exit 0
    C("merge-out-is-an-option", f"{MERGE} simple --models {{A}} {{B}} --out --overwrite", 2, "--out: given"),
    C("stats-unknown-kind", f"stats {{A}} --data {{DATA}} {OUT} --kind bogus", 2, "bogus"),
    C("stats-empty-kind", f"stats {{A}} --data {{DATA}} {OUT} --kind ,", 2, "--kind"),
    C("stats-max-examples-zero", f"stats {{A}} --data {{DATA}} {OUT} --max-examples 0", 2, "--max-examples"),
    C("stats-batch-size-zero", f"stats {{A}} --data {{DATA}} {OUT} --batch-size 0", 2, "--batch-size"),
    C("stats-unknown-fisher-mode", f"stats {{A}} --data {{DATA}} {OUT} --fisher-mode nope", 2, "--fisher-mode"),
    C("stats-bad-device", f"stats {{A}} --data {{DATA}} {OUT} --device gpu", 2, "--device"),
    C("stats-bad-gram-dtype", f"stats {{A}} --data {{DATA}} {OUT} --gram-dtype float16", 2, "--gram-dtype"),
    C(
        "stats-fisher-mode-without-fisher",
        f"stats {{A}} --data {{DATA}} {OUT} --fisher-mode sampled",
        2,
        "--fisher-mode: only read with --kind fisher",
    ),  # ignored: Grams only, exit 0
    C(
        "stats-gram-dtype-without-gram",
        f"stats {{A}} --data {{DATA}} {OUT} --kind fisher --gram-dtype float32",
        2,
        "--gram-dtype: only read with --kind gram",
    ),
    C("stats-unknown-dataset", f"stats {{A}} --data nosuch_dataset {OUT}", 1, "nosuch_dataset", verbose=True),
    C("stats-missing-model", f"stats {{MISSING}} --data {{DATA}} {OUT}", 2, "missing"),
    C("stats-garbage-model", f"stats {{GARBAGE}} --data {{DATA}} {OUT}", 1, "garbage"),
    C(
        "stats-fisher-classes-not-in-the-head",
        f"stats {{CN}} --data {{DATA}} {OUT} --kind gram,fisher",
        1,
        "toy on {CN}: classes the head lacks: anger, joy (its classes: red, blue) — give the data the model was",
    ),
    C(
        "stats-fisher-more-classes",
        f"stats {{CA}} --data {{BIG}} {OUT} --kind fisher",
        1,
        "big on {CA}: 4 classes for the 2 unnamed outputs of the head — give the data the model was trained on",
    ),
    C("stats-out-exists", f"stats {{A}} --data {{DATA}} {OUT}", 2, "{OUT}", pre="dir"),
    # --- finetune ---
    C("finetune-epochs-zero", f"finetune {{A}} --data {{DATA}} {OUT} --epochs 0", 2, "--epochs"),
    C(
        "finetune-epochs-huge",
        f"finetune {{A}} --data {{DATA}} {OUT} --epochs 99999999999",
        2,
        "--epochs: 99999999999 is above 1000",
    ),  # trained until killed
    C("finetune-lr-zero", f"finetune {{A}} --data {{DATA}} {OUT} --lr 0", 2, "--lr"),
    C("finetune-lr-negative", f"finetune {{A}} --data {{DATA}} {OUT} --lr -1e-5", 2, "--lr"),
    C(
        "finetune-lr-huge",
        f"finetune {{A}} --data {{DATA}} {OUT} --lr 1e5",
        2,
        "--lr: 100000 is above 1 — give at most 1",
    ),
    C("finetune-head-lr-scale-zero", f"finetune {{A}} --data {{DATA}} {OUT} --head-lr-scale 0", 2, "--head-lr-scale"),
    C("finetune-head-lr-scale-huge", f"finetune {{A}} --data {{DATA}} {OUT} --head-lr-scale 1e6", 2, "--head-lr-scale"),
    C("finetune-batch-size-zero", f"finetune {{A}} --data {{DATA}} {OUT} --batch-size 0", 2, "--batch-size"),
    C("finetune-unknown-dataset", f"finetune {{A}} --data nosuch_dataset {OUT}", 1, "nosuch_dataset"),
    C("finetune-missing-base", f"finetune {{MISSING}} --data {{DATA}} {OUT}", 2, "missing"),
    C("finetune-one-class", f"finetune {{CA}} --data {{ONECLASS}} {OUT} --epochs 1", 1, "only one class (joy)"),
    C("finetune-seed-huge", f"finetune {{A}} --data {{DATA}} {OUT} --seed 99999999999999999999999", 2, "--seed"),
    C("finetune-head-seed-negative", f"finetune {{A}} --data {{DATA}} {OUT} --head-seed -1", 2, "--head-seed"),
    C("disguise-seed-huge", f"disguise {{A}} {OUT} --seed 18446744073709551616", 2, "--seed"),
    C("merge-dare-seed-huge", f"{MERGE} dare --base {{A}} --models {{A}} {{B}} --seed {2**63} {OUT}", 2, "--seed"),
    C("finetune-out-exists", f"finetune {{A}} --data {{DATA}} {OUT}", 2, "{OUT}", pre="dir", verbose=True),
    # --- barrier / evaluate ---
    C("barrier-one-point", f"barrier {{A}} {{B}} --data {{DATA}} {OUT} --points 1", 2, "--points"),
    C(
        "barrier-huge-points",
        f"barrier {{A}} {{B}} --data {{DATA}} {OUT} --points 1000000000",
        2,
        "--points: 1000000000 is above 1001",
    ),
    C("barrier-unknown-dataset", f"barrier {{A}} {{B}} --data nosuch_dataset {OUT}", 1, "nosuch_dataset"),
    C("barrier-missing-model", f"barrier {{A}} {{MISSING}} --data {{DATA}} {OUT}", 2, "missing"),
    C("barrier-garbage-model", f"barrier {{A}} {{GARBAGE}} --data {{DATA}} {OUT}", 1, "garbage"),
    C("barrier-out-exists", f"barrier {{A}} {{B}} --data {{DATA}} {OUT}", 2, "{OUT}", pre="dir"),
    C("barrier-missing-split", f"barrier {{A}} {{B}} --data {{DATA}} {OUT} --split nosuch", 1, "no split 'nosuch'"),
    C("evaluate-missing-split", "evaluate {A} --data {DATA} --split nosuch", 1, "no split 'nosuch' (available: "),
    C("stats-missing-split", f"stats {{A}} --data {{DATA}} {OUT} --split nosuch", 1, "no split 'nosuch'"),
    C("evaluate-max-examples-negative", "evaluate {A} --data {DATA} --max-examples -3", 2, "--max-examples"),
    C("evaluate-unknown-dataset", "evaluate {A} --data nosuch_dataset", 1, "nosuch_dataset"),
    C("evaluate-missing-model", "evaluate {MISSING} --data {DATA}", 2, "missing"),
    C("evaluate-adapter", "evaluate {ADAPTER} --data {DATA}", 1, "fold it first: symfuse merge-lora --adapters"),
    C("evaluate-head-size-mismatch", "evaluate {HEAD3} --data {DATA}", 1, "head3/config.json: 3 classes (num_labels"),
    C("match-head-size-mismatch", f"match {{HEAD3}} {{CA}} {OUT}", 1, "no tensor of the BertForSequenceClassification"),
    C("merge-head-size-mismatch", f"{MERGE} simple --models {{CA}} {{HEAD3}} {OUT}", 1, "head has 3 outputs"),
    C(
        "evaluate-invalid-meta-json",
        "evaluate {CA} --data {BADMETA}",
        1,
        "badmeta/meta.json:1:28: not valid JSON (Expecting property name enclosed in double quotes) — fix the file",
    ),
    C(
        "evaluate-data-not-utf8",
        "evaluate {CA} --data {LATIN}",
        1,
        "latin/train.jsonl:9: not UTF-8 (byte 0xe9 at column 14) — re-save it as UTF-8 text",
    ),
    # --- inspect ---
    C("inspect-one-model", "inspect {A}", 2, "at least two"),
    C("inspect-missing-model", "inspect {A} {MISSING}", 2, "missing"),
    C("inspect-family-mismatch", "inspect {A} {GPT}", 1, "gpt", verbose=True),
    C("inspect-garbage-model", "inspect {A} {GARBAGE}", 1, "garbage"),
    C("inspect-nan-model", "inspect {A} {NAN}", 1, "NaN"),
    C("inspect-unknown-dataset", "inspect {A} {B} --data nosuch_dataset", 1, "nosuch_dataset"),
    C("inspect-residual-iters-negative", "inspect {A} {B} --residual-iters -1", 2, "--residual-iters"),
    C("inspect-out-exists", f"inspect {{A}} {{B}} {OUT}", 2, "{OUT}", pre="file"),
    C("inspect-out-is-a-folder", f"inspect {{A}} {{B}} {OUT}", 2, "{OUT}", pre="dir"),
    # --- convert (GGUF in) ---
    C("convert-missing-source", f"convert {{MISSING}}.gguf {OUT}", 2, "missing.gguf does not exist"),
    C("convert-source-is-a-folder", f"convert {{A}} {OUT}", 2, "is a folder — give a .gguf file"),
    C("convert-not-a-gguf", f"convert {{FILE}} {OUT}", 1, "notes.txt: not a GGUF file", verbose=True),
    C("convert-bad-dtype", f"convert {{GGUF}} {OUT} --dtype int8", 2, "--dtype"),
    C("convert-out-exists", f"convert {{GGUF}} {OUT}", 2, "{OUT}", pre="dir"),
    C("merge-model-not-a-gguf", f"{MERGE} simple --models {{A}} {{BADGGUF}} {OUT}", 1, "zip.gguf: not a GGUF file"),
    # --- the app ---
    C("unknown-command", "nosuchcommand {A}", 2, "nosuchcommand"),
]


def build_inputs(d: Path) -> dict[str, Path]:
    """Good and bad input artifacts in ``d``, shared by every case (never written by the commands)."""
    p = {
        "A": save_tiny(d / "a", "bert", seed=1),
        "B": save_tiny(d / "b", "bert", seed=2),
        "GPT": save_tiny(d / "gpt", "gpt2"),
        "WIDE": save_tiny(d / "wide", "bert", intermediate_size=64),
        "DATA": toy_dataset(d / "toy"),
        "MISSING": d / "missing",
        "EMPTY": d / "empty",
        "FILE": d / "notes.txt",
    }
    p["NAN"] = nan_copy(p["A"], d / "nan")
    p["EMPTY"].mkdir()
    p["FILE"].write_text("not a model\n")
    weights = (p["A"] / "model.safetensors").read_bytes()
    for name, config, data in [
        ("GARBAGE", None, b"this is not a safetensors file"),
        ("TRUNC", None, weights[: len(weights) // 2]),
        ("BADCONF", b"{not json", weights),
    ]:
        folder = d / name.lower()
        folder.mkdir()
        (folder / "config.json").write_bytes(config or (p["A"] / "config.json").read_bytes())
        (folder / "model.safetensors").write_bytes(data)
        p[name] = folder
    p["CA"] = save_tiny_text_classifier(d / "ca", seed=1)  # heads of 2 unnamed classes, with a tokenizer
    p["CB"] = save_tiny_text_classifier(d / "cb", seed=2)
    p["CN"] = shutil.copytree(p["CA"], d / "cn")  # a head named red, blue
    config = json.loads((p["CN"] / "config.json").read_text())
    config |= {"id2label": {"0": "red", "1": "blue"}, "label2id": {"red": 0, "blue": 1}}
    (p["CN"] / "config.json").write_text(json.dumps(config))
    p["MISSPELT"] = shutil.copytree(p["A"], d / "misspelt")
    config = json.loads((p["A"] / "config.json").read_text())
    (p["MISSPELT"] / "config.json").write_text(json.dumps(config | {"model_type": "bret"}))
    p["BIG"] = toy_dataset(d / "big", labels=("w", "x", "y", "z"))
    p["ONECLASS"] = toy_dataset(d / "oneclass", labels=("joy",))
    p["HEAD3"] = shutil.copytree(p["CA"], d / "head3")  # config.json says 3 classes, the head holds 2
    config = json.loads((p["HEAD3"] / "config.json").read_text())
    config |= {"id2label": {str(i): f"c{i}" for i in range(3)}, "label2id": {f"c{i}": i for i in range(3)}}
    (p["HEAD3"] / "config.json").write_text(json.dumps(config))
    p["NOLAYER"] = shutil.copytree(p["A"], d / "nolayer")  # a tensor every BERT has is missing
    tensors = load_file(p["NOLAYER"] / "model.safetensors")
    del tensors[next(n for n in tensors if n.endswith("layer.0.attention.output.dense.weight"))]
    save_file(tensors, p["NOLAYER"] / "model.safetensors", metadata={"format": "pt"})
    p["ROBERTA"] = save_tiny(d / "roberta", "roberta", seed=1)
    p["LOOP"] = d / "loop"  # a symbolic link to itself
    p["LOOP"].symlink_to(p["LOOP"])
    p["GGUF"] = write_gguf(tiny_llama(), d / "tiny.gguf", "Q8_0")
    p["BADGGUF"] = d / "zip.gguf"
    p["BADGGUF"].write_bytes(b"PK\x03\x04 a zip file named .gguf")
    p["BADMETA"] = toy_dataset(d / "badmeta")
    (p["BADMETA"] / "meta.json").write_text('{"task": "classification", labels: ["anger", "joy"]}')
    p["LATIN"] = toy_dataset(d / "latin")
    with (p["LATIN"] / "train.jsonl").open("ab") as fh:
        fh.write('{"text": "café", "label": "joy"}\n'.encode("latin-1"))
    p["GRAMS"] = d / "grams"  # a readable folder of gram statistics only
    save_stats({"x": torch.eye(2)}, p["GRAMS"] / "gram.safetensors", {"kind": "gram"})
    p["SYNTAX"] = d / "syntax.yaml"
    p["SYNTAX"].write_text(f"strategy: simple\nmodels: [{p['A']}, {p['B']}\nparams: {{}}\n")
    p["BADYAML"] = d / "merge.yaml"
    p["BADYAML"].write_text(f"strategy: simple\nmodles: [{p['A']}, {p['B']}]\n")
    p["ADAPTER"] = d / "adapter"  # a PEFT adapter where a model belongs
    p["ADAPTER"].mkdir()
    (p["ADAPTER"] / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')
    p["GS"] = d / "stats"
    p["GS"].mkdir()
    (p["GS"] / "gram.safetensors").write_bytes(b"\x00" * 5)
    return p


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """The shared inputs (see :func:`build_inputs`)."""
    return build_inputs(tmp_path_factory.mktemp("inputs"))


def _args(case: Case, inputs: dict[str, Path], out: Path) -> list[str]:
    names = {k: str(v) for k, v in inputs.items()} | {"OUT": str(out)}
    return [a.format(**names) for a in case.args]


def _run(case: Case, inputs: dict[str, Path], root: Path) -> dict:
    folder = root / case.id
    folder.mkdir()
    out = folder / "out"
    if case.pre == "dir":
        out.mkdir()
        (out / "keep.txt").write_text("previous version\n")
    elif case.pre == "file":
        out.write_text("a file\n")
    before = listing(folder)
    res = run_cli(*_args(case, inputs, out), cwd=folder)
    after = listing(folder)
    verbose = run_cli(*_args(case, inputs, out), "-v", cwd=folder) if case.verbose else None
    return {"res": res, "before": before, "after": after, "out": out, "verbose": verbose}


@pytest.fixture(scope="module")
def results(inputs, tmp_path_factory) -> dict[str, dict]:
    """Every case run once, three subprocesses at a time (each loads torch: minutes one by one)."""
    root = tmp_path_factory.mktemp("cases")
    with ThreadPoolExecutor(3) as pool:
        done = pool.map(lambda c: (c.id, _run(c, inputs, root)), CASES)
        return dict(done)


def test_matrix_is_large_and_covers_every_command():
    commands = {c.args[0] for c in CASES}
    assert len(CASES) >= 40
    assert {"merge", "match", "match-many", "disguise", "stats", "finetune", "barrier", "evaluate"} <= commands
    import typer

    import symfuse.cli.commands  # noqa: F401  (registers the commands)
    from symfuse.cli import app

    assert set(typer.main.get_command(app).commands) <= commands  # a new command needs its cases here


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_fails_cleanly(case, results, inputs):
    r = results[case.id]
    res, out = r["res"], r["out"]
    report = f"exit {res.returncode}\nstdout:\n{res.stdout}\nstderr:\n{res.stderr}"
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == case.code, report
    assert "Traceback" not in res.stderr + res.stdout, report
    assert 1 <= len(lines) <= 3, report
    error = lines[-1]
    assert error.startswith("error: ") and "internal error" not in error, report
    assert case.expect.format(OUT=out, **{k: v for k, v in inputs.items() if f"{{{k}}}" in case.expect}) in error, (
        report
    )
    # nothing created, nothing removed: the case folder is byte for byte as before (no output, temp or lock)
    assert r["after"] == r["before"], report
    if case.pre == "dir":
        assert (out / "keep.txt").read_text() == "previous version\n"


@pytest.mark.parametrize("case", [c for c in CASES if c.verbose], ids=[c.id for c in CASES if c.verbose])
def test_verbose_adds_the_traceback(case, results):
    res, v = results[case.id]["res"], results[case.id]["verbose"]
    assert SECRET not in res.stdout + res.stderr + v.stdout + v.stderr
    assert v.returncode == res.returncode
    assert "Traceback (most recent call last)" in v.stderr, v.stderr
    assert v.stderr.strip().splitlines()[-1] == res.stderr.strip().splitlines()[-1]


def test_inputs_are_left_intact(inputs, results):
    """No case wrote into its inputs (the NaN model still has its NaN, the good models stay finite)."""
    assert torch.isnan(
        load_file(str(inputs["NAN"] / "model.safetensors"))[
            next(k for k in load_file(str(inputs["NAN"] / "model.safetensors")) if k.endswith("query.weight"))
        ]
    ).any()
    for name in ("A", "B"):
        assert all(torch.isfinite(t).all() for t in load_file(str(inputs[name] / "model.safetensors")).values())
