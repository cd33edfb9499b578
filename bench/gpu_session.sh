#!/usr/bin/env bash
# The device run of a session lent a GPU machine (one call, < 10 min): bench/gpu_check.py, then the LMC benchmark's
# training (bench/lmc_train.py) into .lmc_runs/, its d-256 models packed for the trip back (float16, one tar each).
# On that machine: the carried wheels (.whl: the locked transformers / tokenizers / pydantic / datasets, absent or
# older there) go first on PYTHONPATH; the MiniLM tokenizer for the parity checks is carried in .gpuck/.
# Usage: bash bench/gpu_session.sh OUT [SECONDS]   (SECONDS: the whole run's budget, default 570)
set -uo pipefail
OUT=${1:?give the output folder}
BUDGET=${2:-570}
START=$SECONDS
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD/src:$PWD" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
timeout $((BUDGET * 55 / 100)) python3 bench/gpu_check.py --out "$OUT" --work /tmp/gpu-check --tokenizer .gpuck/minilm-tokenizer
echo "gpu_check rc $? after $((SECONDS - START)) s"
LEFT=$((BUDGET - (SECONDS - START) - 20))
timeout "$LEFT" python3 bench/lmc_train.py all --out .lmc_runs --seeds 0 1 2 --wide-seed 3 --save-dtype float16 \
  --checkpoint-every 5
echo "lmc_train rc $? after $((SECONDS - START)) s"
for d in .lmc_runs/seed*; do
  [ -f "$d/train_log.json" ] && tar -cf "$OUT/$(basename "$d").tar" -C .lmc_runs "$(basename "$d")"
done
ls -la "$OUT"
