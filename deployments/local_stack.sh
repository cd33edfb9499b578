#!/usr/bin/env bash
# Local Prefect stack for symfuse (see deployments/stack.py):
#   deployments/local_stack.sh start [--port 4200] [--gpus 0,1]   server on 127.0.0.1, pool gpu, tag limit,
#                                                                  prefect deploy, automations, one worker per GPU
#   deployments/local_stack.sh status
#   deployments/local_stack.sh stop                                workers first, then the server
set -euo pipefail
cd "$(dirname "$0")/.."
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=${PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS:-120}
PY=${PYTHON:-.venv/bin/python}
exec "$PY" deployments/stack.py "${@:-start}"
