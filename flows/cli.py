"""The demo's command line: ``python -m flows [--quick] [--config run.yaml] [--store DIR] [--run-id ID] [-v]``.

Runs :func:`flows.pipeline.fusion_pipeline` (ephemeral Prefect unless ``PREFECT_API_URL`` points at a server) on the
embedded demo config or a YAML file, then prints the metrics table from the stored report. A bad ``--config`` or a
failed run ends with ONE ``error:`` line and a non-zero exit (2: the config, 1: the run; the run's logs say which
task failed); tracebacks, also those Prefect logs for a failed task or flow, only with ``-v``. Before Prefect
starts, every input the config names is checked (:func:`symfuse.preflight.check_run`): each problem is one
``error:`` line (all of them at once), exit 1, nothing run.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys
import threading
import time
from typing import Any
from uuid import UUID

import pandas as pd

from flows.server import own_session_server
from symfuse.cli.boundary import DATA, INTERRUPTED, one_line, report
from symfuse.config import DATASET_RESOLUTION, DEMO_DATASETS, DEMO_OUT_OF_DOMAIN, RunConfig
from symfuse.config_schema import check_name
from symfuse.errors import INTERRUPTED_STARTING, UsageError
from symfuse.logs import quiet_third_party
from symfuse.preflight import check_run
from symfuse.redact import redact
from symfuse.report import metrics_table, primary_metric
from symfuse.store import ArtifactStore
from symfuse.store.urls import lasting_store_problem

TERMINATED = 128 + signal.SIGTERM  # the exit status of a run stopped by SIGTERM
STOP_GRACE_S = 20.0  # after SIGTERM / SIGINT, running tasks have this long to end before the process ends anyway
STOPPED_BY: list[str] = []  # the signal that stopped the run (SIGTERM / SIGINT), set by exit_on_signals' handler
DEMO_DATA_HELP = (
    f"The embedded demo fine-tunes on {', '.join(DEMO_DATASETS)} and evaluates out of domain on "
    f"{', '.join(DEMO_OUT_OF_DOMAIN)}: subsets bundled with the package (sources and licences in "
    f"symfuse/data/demo/SOURCES.md). {DATASET_RESOLUTION}"
)


class _Once(argparse.Action):
    """Store the value; an option given twice is an error (argparse would keep the last one without a word)."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: Any = None
    ) -> None:
        if getattr(namespace, self.dest) is not None:
            parser.error(f"{option}: given twice — give it once")
        setattr(namespace, self.dest, values)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The demo's options."""
    p = argparse.ArgumentParser(prog="python -m flows", description=__doc__.splitlines()[0], epilog=DEMO_DATA_HELP)
    p.add_argument(
        "--quick", action="store_true", help="the reduced demo: crowdflower and meld, 300 examples (target < 90 s)"
    )
    p.add_argument("--config", action=_Once, help="RunConfig YAML file (default: the embedded demo)")
    p.add_argument("--store", action=_Once, help="artifact store root (default: $SYMFUSE_STORE or ./symfuse-runs)")
    p.add_argument("--run-id", action=_Once, help="run id (names runs/<id>/ in the store)")
    p.add_argument("-v", "--verbose", action="store_true", help="print tracebacks (errors are one line without it)")
    return p.parse_args(argv)


def load_config(args: argparse.Namespace) -> RunConfig:
    """The run config from the options."""
    overrides = {k: v for k, v in {"store_root": args.store, "run_id": args.run_id}.items() if v}
    if args.config:
        config = RunConfig.from_yaml(args.config)
        for field, value in overrides.items():  # validated as the file's fields are (validate_assignment)
            setattr(config, field, value)
        return config
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


class _NoTraceback(logging.Formatter):
    """A console formatter's output without the exception text or stack a record carries (nothing is cached)."""

    def __init__(self, inner: logging.Formatter | None) -> None:
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        saved = record.exc_info, record.exc_text, record.stack_info
        record.exc_info = record.exc_text = record.stack_info = None
        try:
            return self.inner.format(record)
        finally:
            record.exc_info, record.exc_text, record.stack_info = saved


def hide_tracebacks_on_console() -> None:
    """Console log handlers print records without tracebacks (the API handler still sends them to the run's logs)."""
    from prefect.logging.handlers import APILogHandler

    named = (v for v in logging.Logger.manager.loggerDict.values() if isinstance(v, logging.Logger))
    for log in (logging.getLogger(), *named):
        for handler in log.handlers:
            console = isinstance(handler, logging.StreamHandler) and not isinstance(handler, APILogHandler)
            if console and not isinstance(handler.formatter, _NoTraceback):
                handler.setFormatter(_NoTraceback(handler.formatter))


def exit_on_signals(grace_s: float = STOP_GRACE_S) -> None:
    """End the run on SIGTERM (``SystemExit(143)``) or SIGINT (``KeyboardInterrupt``), and end the process anyway.

    Python's default SIGTERM kills the process at once; Prefect, after stopping a flow, re-sends the signal to that
    default, and the ephemeral server's subprocess was left running (one per stopped demo). The orderly exit waits
    for running tasks, which end at their next step; a task stuck in one long call, or Prefect's clients retrying a
    server already gone (a Ctrl-C reaches the server's process too), once held a stopped run for more than ten
    minutes. So ``grace_s`` after the first signal, or at a second one, the process stops the ephemeral server and
    ends at once, saying so. The signal is recorded in :data:`STOPPED_BY`.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    STOPPED_BY.clear()

    def on_signal(signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if STOPPED_BY:
            _end_now(f"a second {name}", signum)
        STOPPED_BY.append(name)
        late = f"the run had not stopped {grace_s:.0f} s after {name}"
        watchdog = threading.Timer(grace_s, _end_now, [late, signum])
        watchdog.daemon = True
        watchdog.start()
        if signum == signal.SIGTERM:
            sys.exit(TERMINATED)
        raise KeyboardInterrupt

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)


def _end_now(why: str, signum: int) -> None:
    """Stop the ephemeral server (5 s at most, then killed) and end the process at once (143 SIGTERM, 130 SIGINT)."""
    try:
        from prefect.server.api.server import SubprocessASGIServer

        for server in list(SubprocessASGIServer._instances.values()):
            server.stop()
    except Exception:  # ending matters more than a clean stop here
        logging.getLogger(__name__).debug("stopping the ephemeral server failed", exc_info=True)
    print(f"error: {why} — ended without waiting for the running tasks; what the run finished is in the store",
          file=sys.stderr, flush=True)  # fmt: skip
    os._exit(TERMINATED if signum == signal.SIGTERM else INTERRUPTED)


def quiet_temporary_server(verbose: bool) -> None:
    """Without ``-v``, the temporary server's own logs stay off the console (a value the user set wins).

    The server runs in a child process that writes to this console: under load its sqlite database logs "database is
    locked" and event-flush errors with tracebacks. Those concern the server's records for the UI, never the run's
    result, which the flow reports as one line; ``-v`` shows them.

    Args:
        verbose: Leave the server's logging as Prefect sets it.
    """
    if not verbose:
        os.environ.setdefault("PREFECT_SERVER_LOGGING_LEVEL", "CRITICAL")


def start_ephemeral_server() -> threading.Thread | None:
    """Start Prefect's ephemeral server in a thread (None when a server URL is set or ephemeral mode is off).

    The flow would start the same server (one per process) on its first API call; starting it here overlaps its
    start-up with other work. Join the thread before the flow runs: a started but not yet healthy server would be
    taken as ready. A failure here is left to the flow, which starts the server again and reports its error.
    """
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return None

    def start() -> None:
        try:
            own_session_server().start()
        except Exception:  # the flow retries the start and reports its error
            logging.getLogger(__name__).debug("early start of the ephemeral server failed", exc_info=True)

    thread = threading.Thread(target=start, name="prefect-ephemeral-start", daemon=True)
    thread.start()
    return thread


def drain_events(flow_run_id: UUID | None, timeout_s: float = 20.0, poll_s: float = 0.2) -> bool:
    """Send the run's last events to the server and wait until it has recorded them, before the process stops it.

    A flow whose tasks were all reused ends within a second of its last task-run events; the ephemeral server is
    stopped at exit while it is still writing them, and logs "Error flushing ... events" with tracebacks (harmless,
    but on the user's console). A fixed pause was too short on a busy 2-core machine, so this polls the API: the
    server records a flow's task-run events in the order they came, so once every task run it holds is in a final
    state and their number holds still across two polls, the last event has been written.

    Args:
        flow_run_id: The finished flow run (None: drain only).
        timeout_s: Give up after this long (best effort: the events are for the UI; the results are stored).
        poll_s: Pause between two reads of the flow run's task runs.

    Returns:
        Whether the server was seen to hold every task run in a final state.
    """
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.events.worker import EventsWorker

    log = logging.getLogger(__name__)
    try:
        EventsWorker.drain_all(timeout=timeout_s, at_exit=False)
        if flow_run_id is None:
            return False
        deadline = time.monotonic() + timeout_s
        runs = FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        seen: list[tuple[str, bool]] | None = None
        with get_client(sync_client=True) as client:
            while time.monotonic() < deadline:
                now = sorted(_task_run_states(client, runs))
                if now and now == seen and all(final for _, final in now):
                    return True
                seen = now
                time.sleep(poll_s)
    except Exception:  # best effort, as above
        log.debug("waiting for Prefect to record the run's events failed", exc_info=True)
        return False
    log.debug("Prefect had not recorded every task run of %s after %.0f s", flow_run_id, timeout_s)
    return False


def _task_run_states(client: Any, runs: Any, page: int = 200) -> list[tuple[str, bool]]:
    """(task run id, whether its state is final) for every task run of the filtered flow runs, read page by page."""
    out: list[tuple[str, bool]] = []
    while True:
        batch = client.read_task_runs(flow_run_filter=runs, limit=page, offset=len(out))
        out += [(str(r.id), bool(r.state and r.state.is_final())) for r in batch]
        if len(batch) < page:
            return out


def main(argv: list[str] | None = None) -> int:
    """Run the pipeline and print its metrics; returns the exit status (a Ctrl-C before the run: one line, 130)."""
    main_thread = threading.current_thread() is threading.main_thread()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)} if main_thread else {}
    try:
        return _main(argv)
    except KeyboardInterrupt:  # while the inputs were checked, before the run started
        print(INTERRUPTED_STARTING, file=sys.stderr)
        return INTERRUPTED
    finally:
        if not STOPPED_BY:  # an in-process caller (a test) gets its handlers back; a stopped run keeps its watchdog's
            for sig, handler in handlers.items():
                signal.signal(sig, handler)


def _main(argv: list[str] | None) -> int:
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    # library lines in the run's logs (read when Prefect sets up logging; the flows also attach the handler)
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "symfuse,tasks")
    quiet_third_party()  # the pipeline's progress and table, not a load report per checkpoint
    args = parse_args(argv)
    try:
        if args.run_id is not None:  # the option's own line, not the file's (the file is fine)
            check_name(args.run_id, "--run-id: run id")
        if args.quick and args.config:  # it reduces the demo: a config file ran whole, without a word
            raise ValueError(f"--quick reduces the demo config and is ignored with --config {args.config} — drop one "
                             "(cap a config's sizes with max_train_examples / max_eval_examples)")  # fmt: skip
        if args.store == "":  # an empty --store fell back to $SYMFUSE_STORE without a word
            raise ValueError("--store is empty — give the store root (a folder or URL), or leave the option out")
    except ValueError as exc:
        return report(UsageError(f"{exc}"), args.verbose)
    try:
        config = load_config(args)
    except Exception as exc:  # a bad --config: one line naming the file, exit 2
        where = args.config or "the demo config"
        text = one_line(exc).removeprefix("error: ").removeprefix(f"{where}: ")  # the file named once
        fix = "" if " — " in text else " — fix the file (RunConfig fields: README)"
        return report(UsageError(f"{where}: {text}{fix}"), args.verbose)
    where = "--store" if args.store else f"store_root of {args.config}" if config.store_root else "$SYMFUSE_STORE"
    if problem := lasting_store_problem(config.resolved_store_root(), where):
        return report(UsageError(problem), args.verbose)
    problems = check_run(config)  # every bad input at once, in seconds, before Prefect starts or anything trains
    if config.fan_out == "deployments" and not problems:  # the stage deployments on the server (imports Prefect)
        from tasks.fanout import deployment_problems

        problems = deployment_problems(config)
    if problems:
        for line in problems:
            print(f"error: {redact(line)}", file=sys.stderr)
        return DATA
    start = time.perf_counter()
    exit_on_signals()
    quiet_temporary_server(args.verbose)
    try:
        server = start_ephemeral_server()  # in a thread: ~6 s of start-up while this thread imports and warms up
        from flows.pipeline import fusion_pipeline  # torch, transformers, prefect (``python -m flows``: not yet)
        from tasks.common import warm_imports

        warm_imports(config.base_model)
        gc.freeze()  # the imported modules' objects: never garbage, no longer walked by every full collection
        if server is not None:
            server.join()
        if not args.verbose:  # once Prefect's handlers exist (set up by its import and the server's start)
            hide_tracebacks_on_console()
        state = fusion_pipeline(config, return_state=True)
        # the ephemeral server stops at exit: wait until it has recorded the run (a real server keeps running)
        ephemeral_done = server is not None and state.is_completed()
        drain_events(state.state_details.flow_run_id if ephemeral_done else None)
        result = state.result()
    except (Exception, SystemExit, KeyboardInterrupt) as exc:
        stopped = STOPPED_BY[0] if STOPPED_BY else "SIGINT" if isinstance(exc, KeyboardInterrupt) else None
        if stopped is None:  # the failed task's own error, one line (its traceback is in the run's logs)
            if isinstance(exc, Exception):
                return report(exc, args.verbose)
            raise
        # SIGTERM or Ctrl-C, whatever the engine raised after it (a ConnectError once the server got the Ctrl-C too)
        why = "terminated by SIGTERM" if stopped == "SIGTERM" else "interrupted"
        store = redact(config.resolved_store_root())
        print(f"error: {why} — the run stopped; what it finished is in the store {store}, and the same command "
              "resumes from it", file=sys.stderr)  # fmt: skip
        return TERMINATED if stopped == "SIGTERM" else INTERRUPTED
    print_metrics(result["report"], config)
    print(f"\nanchor: {result['anchor']}; pipeline wall time {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
