#!/usr/bin/env bash
# The main job. Until the pipeline lands: match the real MiniLM against a disguised copy of itself.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
out=${SYMFUSE_DEMO_DIR:-symfuse-runs/demo-match}
rm -rf "$out"
.venv/bin/symfuse disguise minilm --out "$out/disguised" --seed 1
.venv/bin/symfuse match "$out/disguised" minilm --out "$out/matched"
