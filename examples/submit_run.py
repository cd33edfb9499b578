"""Submit a run config to the ``fusion-pipeline`` deployment: the pipeline runs on a worker of the work pool.

    deployments/local_stack.sh start                      # server, pool `gpu`, deployments, workers
    export PREFECT_API_URL=http://127.0.0.1:4200/api
    .venv/bin/python examples/submit_run.py examples/run.yaml [--wait]

The config is checked here first (every input it names, :func:`symfuse.preflight.check_run`: one ``error:`` line
per problem, exit 1, nothing submitted). Without ``--wait`` the script prints the flow run's id and returns; follow
the run in the UI (http://127.0.0.1:4200). The worker writes under the config's store (``store_root``, else the
worker's ``$SYMFUSE_STORE``, else ``./symfuse-runs`` in the checkout): ``runs/<run_id>/report/`` holds the report.
"""

from __future__ import annotations

import argparse
import sys

from prefect.settings import PREFECT_API_URL

from symfuse.cli.boundary import one_line
from symfuse.config import RunConfig
from symfuse.preflight import check_run

DEPLOYMENT = "fusion-pipeline/fusion-pipeline"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The script's options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config", help="RunConfig YAML file (e.g. examples/run.yaml)")
    p.add_argument("--wait", action="store_true", help="wait for the flow run to finish and print its final state")
    p.add_argument("--check", action="store_true", help="only check the config and its inputs; submit nothing")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Check the config, then start one flow run of the deployment; returns the exit status."""
    args = parse_args(argv)
    try:
        config = RunConfig.from_yaml(args.config)
    except Exception as exc:  # a missing file, an unknown key, a bad value: one line naming the file
        text = one_line(exc).removeprefix("error: ").removeprefix(f"{args.config}: ")
        print(f"error: {args.config}: {text}", file=sys.stderr)
        return 1
    problems = check_run(config)
    if not args.check and not PREFECT_API_URL.value():  # a temporary server would hold the run, and no worker
        problems.append(
            "PREFECT_API_URL is unset: nothing would run the flow — start the stack "
            "(deployments/local_stack.sh start) and export PREFECT_API_URL=http://127.0.0.1:4200/api"
        )
    for line in problems:
        print(f"error: {line}", file=sys.stderr)
    if problems or args.check:
        return 1 if problems else 0
    from prefect.deployments import run_deployment

    params = {"config": config.model_dump(mode="json")}
    run = run_deployment(DEPLOYMENT, parameters=params, timeout=None if args.wait else 0)
    print(f"flow run {run.name} ({run.id}): {run.state.name if run.state else 'submitted'}")
    print(f"results: {config.resolved_store_root()}/runs/{config.run_id}/ (report/report.md) as the worker sees it")
    return 0 if not args.wait or (run.state and run.state.is_completed()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
