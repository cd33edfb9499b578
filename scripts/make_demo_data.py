"""Rebuild the demo's bundled datasets (``src/symfuse/data/demo/``) from ``../shared/datasets``.

    python scripts/make_demo_data.py [--shared ../shared/datasets] [--out src/symfuse/data/demo]

Each bundled set is a seeded subset of the shared one at the full demo's caps (2000 train, 500 validation, 500 test;
the quick demo subsamples these again): ``symfuse.data.subsample_indices(n, cap, seed=13)``, the same rows
``load_task_dataset(name, max_train_examples=2000, max_eval_examples=500, seed=13)`` picks from the shared folder,
copied line for line (bytes unchanged). The out-of-domain set (goemotions_ekman) shares its Reddit texts with
goemotions, so its rows are drawn only among texts that appear in no training set's bundled file (any split).
``meta.json`` keeps the shared task / label list and records source repository, commit, licence and the rule.
Re-running it on the same shared folder rewrites byte-identical files.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from symfuse.data.dataset import subsample_indices  # noqa: E402

SEED = 13
CAPS = {"train": 2000, "validation": 500, "test": 500}
TRAIN_SETS = ("crowdflower", "goemotions", "meld")
OOD_SET = "goemotions_ekman"
OOD_CAPS = {"train": 500, "validation": 500, "test": 500}  # its train split is not used by the demo
LICENCES = {
    "crowdflower": 'Public Domain (CrowdFlower \'Data for Everyone\' datapackage: "license": "Public Domain")',
    "goemotions": "Apache-2.0 (google-research/google-research goemotions/data; monologg/GoEmotions-pytorch)",
    "goemotions_ekman": "Apache-2.0 (google-research/google-research goemotions/data; monologg/GoEmotions-pytorch)",
    "meld": "GPL-3.0 (declare-lab/MELD); utterances from the TV show Friends",
}


def norm(text: str) -> str:
    """The text compared for overlap: case and surrounding spaces ignored."""
    return " ".join(text.lower().split())


def lines(folder: Path, split: str) -> list[str]:
    """The non-empty lines of one split file, in source order."""
    return [ln for ln in (folder / f"{split}.jsonl").read_text(encoding="utf-8").splitlines() if ln.strip()]


def write_subset(src: Path, out: Path, chosen: dict[str, list[str]], rule: str) -> dict[str, int]:
    """Write the chosen lines per split and a meta.json describing them; return the split sizes."""
    out.mkdir(parents=True, exist_ok=True)
    counts: Counter[str] = Counter()
    for split, rows in chosen.items():
        (out / f"{split}.jsonl").write_text("".join(r + "\n" for r in rows), encoding="utf-8")
        for r in rows:
            label = json.loads(r)["label"]
            counts.update(label if isinstance(label, list) else [label])
    meta = json.loads((src / "meta.json").read_text())
    meta["sizes"] = {s: len(r) for s, r in chosen.items()}
    meta.pop("label_counts_all_splits", None)
    meta["label_counts_all_splits"] = dict(sorted(counts.items()))
    meta["licence"] = LICENCES[src.name]
    meta["subset"] = {"of": f"../shared/datasets/{src.name}", "rule": rule, "seed": SEED,
                      "made_by": "scripts/make_demo_data.py"}  # fmt: skip
    (out / "meta.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return meta["sizes"]


def main(argv: list[str] | None = None) -> int:
    """Build every bundled set; print their sizes."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shared", type=Path, default=ROOT.parent / "shared" / "datasets")
    p.add_argument("--out", type=Path, default=ROOT / "src" / "symfuse" / "data" / "demo")
    args = p.parse_args(argv)
    seen: set[str] = set()
    for name in TRAIN_SETS:
        src = args.shared / name
        chosen = {}
        for split, cap in CAPS.items():
            rows = lines(src, split)
            chosen[split] = [rows[i] for i in subsample_indices(len(rows), cap, SEED)]
            seen.update(norm(json.loads(r)["text"]) for r in chosen[split])
        rule = f"subsample_indices(len(split), cap, seed={SEED}) per split, caps {CAPS}"
        print(name, write_subset(src, args.out / name, chosen, rule))
    src = args.shared / OOD_SET
    chosen = {}
    for split, cap in OOD_CAPS.items():
        rows = [r for r in lines(src, split) if norm(json.loads(r)["text"]) not in seen]
        chosen[split] = [rows[i] for i in subsample_indices(len(rows), cap, SEED)]
    rule = (f"rows whose text is in no bundled file of {', '.join(TRAIN_SETS)}, then "
            f"subsample_indices(len(rows), cap, seed={SEED}) per split, caps {OOD_CAPS}")  # fmt: skip
    print(OOD_SET, write_subset(src, args.out / OOD_SET, chosen, rule))
    return 0


if __name__ == "__main__":
    sys.exit(main())
