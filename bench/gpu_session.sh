#!/usr/bin/env bash
# The device run of a session lent a GPU machine (one call, < 10 min): the assignment kernels built there,
# bench/gpu_check.py, then bench/gpu_pipeline.py (the quick pipeline through the local stack, on the GPU).
# On that machine: the carried wheels (.whl: the locked transformers / tokenizers / pydantic / datasets, and Prefect
# with what it needs that the image lacks) go first on PYTHONPATH; the MiniLM tokenizer is carried in .gpuck/.
# Usage: bash bench/gpu_session.sh OUT [SECONDS]   (SECONDS: the whole run's budget, default 540; the pipeline needs ~250 of it)
set -uo pipefail
OUT=${1:?give the output folder}
BUDGET=${2:-540}
START=$SECONDS
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD/src:$PWD" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
lscpu | grep -E "^Model name|^CPU\(s\)" | tr -s ' '
# the compiled assignment kernels (setup.py's flags), as `pip install` builds them where a C compiler is
SUFFIX=$(python3 -c "import importlib.machinery as m; print(m.EXTENSION_SUFFIXES[0])")
cc -O3 -std=c99 -shared -fPIC src/symfuse/match/_lapcore.c -o "src/symfuse/match/_lapcore$SUFFIX" \
  && echo "assignment kernels built: _lapcore$SUFFIX"
timeout $((BUDGET * 55 / 100)) python3 bench/gpu_check.py --out "$OUT" --work /tmp/gpu-check --tokenizer .gpuck/minilm-tokenizer
echo "gpu_check rc $? after $((SECONDS - START)) s"
LEFT=$((BUDGET - (SECONDS - START) - 15))
timeout "$LEFT" python3 bench/gpu_pipeline.py --out "$OUT" --timeout $((LEFT - 45))
echo "gpu_pipeline rc $? after $((SECONDS - START)) s"
ls -la "$OUT"
