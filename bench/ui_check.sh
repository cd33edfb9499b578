#!/usr/bin/env bash
# The UI check of issue 33: a fresh local stack on a NON-default port runs the quick demo pipeline through its
# deployment; headless Chromium then opens the run's artifacts (report, metrics table, merged models, a model card)
# from the UI and screenshots them into bench/results/ui/.
#
#   bash bench/ui_check.sh [PORT]        (default 4610; needs Debian's chromium: apt-get install chromium)
#
# Everything it starts lives under $WORK (default /tmp/symfuse-ui-check) and is stopped at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${1:-4610}
WORK=${WORK:-/tmp/symfuse-ui-check}
OUT=bench/results/ui
PY=.venv/bin/python
rm -rf "$WORK" && mkdir -p "$WORK" "$OUT"
export SYMFUSE_STORE="$WORK/store" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1
stop() { deployments/local_stack.sh stop --home "$WORK/stack" >/dev/null 2>&1 || true; }
trap stop EXIT
deployments/local_stack.sh start --port "$PORT" --home "$WORK/stack"
export PREFECT_API_URL="http://127.0.0.1:$PORT/api"
CONFIG=$("$PY" -c "import json; from symfuse.config import RunConfig; print(json.dumps({'config': RunConfig.demo(quick=True).model_dump(mode='json')}))")
start=$(date +%s)
.venv/bin/prefect deployment run fusion-pipeline/fusion-pipeline --params "$CONFIG" --watch --watch-timeout 3000 \
    > "$WORK/run.log" 2>&1 || { tail -20 "$WORK/run.log"; exit 1; }
echo "quick demo through the deployment: $(( $(date +%s) - start )) s"
# the UI pages of the run and of its artifacts (ids from the API the UI reads)
"$PY" - "$PORT" > "$WORK/pages.txt" <<'EOF'
import sys
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, FlowRunFilter, FlowRunFilterName
from prefect.client.schemas.sorting import FlowRunSort

port = sys.argv[1]
ui = f"http://127.0.0.1:{port}"
with get_client(sync_client=True) as client:
    run = client.read_flow_runs(sort=FlowRunSort.START_TIME_DESC, limit=20)
    run = next(r for r in run if r.state and r.state.is_completed() and (r.parameters or {}).get("config"))
    print(f"run {ui}/runs/flow-run/{run.id}?tab=Artifacts")
    for key in ("demo-quick-report", "demo-quick-metrics", "demo-quick-merged-models", "demo-quick-card-regmean-matched"):
        (art,) = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])), limit=1)
        print(f"{key} {ui}/artifacts/artifact/{art.id}")
EOF
while read -r name url; do
  chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking \
      --disable-component-update --disable-sync --user-data-dir="$WORK/chrome" --window-size=1400,1100 \
      --virtual-time-budget=20000 --screenshot="$OUT/$name.png" "$url" 2>/dev/null
  echo "$name: $url -> $OUT/$name.png"
done < "$WORK/pages.txt"
