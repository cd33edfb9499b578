"""Command line of the demo: ``python -m flows.pipeline [--quick] [--config run.yaml] [--store DIR] [--run-id ID]``.

Runs :func:`flows.pipeline.fusion_pipeline` (ephemeral Prefect unless ``PREFECT_API_URL`` points at a server) on the
embedded demo config or a YAML file, then prints the metrics table from the stored report.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import pandas as pd

from symfuse.config import DATASET_RESOLUTION, DEMO_DATASETS, DEMO_OUT_OF_DOMAIN, RunConfig
from symfuse.logs import quiet_third_party
from symfuse.report import metrics_table, primary_metric
from symfuse.store import ArtifactStore

DEMO_DATA_HELP = (
    f"The embedded demo fine-tunes on {', '.join(DEMO_DATASETS)} and evaluates out of domain on "
    f"{', '.join(DEMO_OUT_OF_DOMAIN)}: subsets bundled with the package (sources and licences in "
    f"symfuse/data/demo/SOURCES.md). {DATASET_RESOLUTION}"
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The demo's options."""
    p = argparse.ArgumentParser(
        prog="python -m flows.pipeline", description=__doc__.splitlines()[0], epilog=DEMO_DATA_HELP
    )
    p.add_argument("--quick", action="store_true", help="the reduced demo (target < 3 min on 2 CPU cores)")
    p.add_argument("--config", help="RunConfig YAML file (default: the embedded demo)")
    p.add_argument("--store", help="artifact store root (default: $SYMFUSE_STORE or ./symfuse-runs)")
    p.add_argument("--run-id", help="run id (names runs/<id>/ in the store)")
    return p.parse_args(argv)


def load_config(args: argparse.Namespace) -> RunConfig:
    """The run config from the options."""
    overrides = {k: v for k, v in {"store_root": args.store, "run_id": args.run_id}.items() if v}
    if args.config:
        config = RunConfig.from_yaml(args.config)
        return config.model_copy(update=overrides) if overrides else config
    return RunConfig.demo(quick=args.quick, **overrides)


def print_metrics(report_uri: str, config: RunConfig) -> pd.DataFrame:
    """Print the headline metric per strategy x {plain, matched} and evaluation set; return that table."""
    store = ArtifactStore(config.resolved_store_root())
    folder = store.local_cache(report_uri)  # the published version (a local store: its own folder)
    long = pd.read_csv(folder / "metrics.csv")
    metric = primary_metric(long)
    table = metrics_table(long, metric)
    with pd.option_context("display.width", 160, "display.max_columns", 20):
        print(f"\n{metric} per strategy x matching (report: {folder / 'report.md'})\n")
        print(table.round(4).to_string())
    return table


def main(argv: list[str] | None = None) -> int:
    """Run the pipeline and print its metrics; returns the exit status."""
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    # library lines in the run's logs (read when Prefect sets up logging; the flows also attach the handler)
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "symfuse,tasks")
    quiet_third_party()  # the pipeline's progress and table, not a load report per checkpoint
    args = parse_args(argv)
    config = load_config(args)
    from flows.pipeline import fusion_pipeline

    start = time.perf_counter()
    result = fusion_pipeline(config)
    print_metrics(result["report"], config)
    print(f"\nanchor: {result['anchor']}; pipeline wall time {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
