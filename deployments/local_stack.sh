#!/usr/bin/env bash
# Local Prefect stack for symfuse (see deployments/stack.py):
#   deployments/local_stack.sh start [--port 4200] [--gpus 0,1] [--force]
#       server on 127.0.0.1 (UI and API on --port), pools gpu + control, prefect deploy of what is new or changed in
#       prefect.yaml (UI edits kept; --force: everything), automations, a pipeline worker, one stage worker per GPU
#       and one control worker (the watcher)
#   deployments/local_stack.sh status
#   deployments/local_stack.sh stop                                workers first, then the server
set -euo pipefail
cd "$(dirname "$0")/.."
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=${PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS:-120}
# library (symfuse.*) and retry-policy (tasks.*) INFO lines in the runs' logs in the UI
export PREFECT_LOGGING_EXTRA_LOGGERS=${PREFECT_LOGGING_EXTRA_LOGGERS:-symfuse,tasks}
PY=${PYTHON:-.venv/bin/python}
exec "$PY" deployments/stack.py "${@:-start}"
