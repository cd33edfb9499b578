#!/usr/bin/env bash
# The main job: fusion_pipeline on the embedded demo (MiniLM fine-tuned on crowdflower, goemotions, meld; Gram + Fisher
# statistics; matching; simple / fisher / regmean / ties (quick: no ties) x plain / matched; in-domain +
# goemotions_ekman evaluation).
# The data ships with the package (src/symfuse/data/demo/, sources and licences in its SOURCES.md).
# Ephemeral Prefect, local store ($SYMFUSE_STORE or ./symfuse-runs). Prints the metrics table at the end.
#   scripts/demo.sh            full demo (target < 8 min on 2 CPU cores)
#   scripts/demo.sh --quick    reduced demo: crowdflower + meld (target < 90 s)
#   scripts/demo.sh --different-init   where symmetry matters: two models from different seeds aligned with each
#                              class and merged (examples/different_init.py; models cached after the first run)
# Other options: --config run.yaml, --store DIR, --run-id ID (see `python -m flows --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=120
# no telemetry: this machine reaches package registries only
export PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1
export SYMFUSE_STORE=${SYMFUSE_STORE:-symfuse-runs}
if [[ "${1:-}" == "--different-init" ]]; then
  shift
  exec .venv/bin/python examples/different_init.py "$@"
fi
exec .venv/bin/python -m flows "$@"  # imports overlap the server start
