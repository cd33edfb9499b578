"""``python -m flows [--quick] [--config run.yaml] [--store DIR] [--run-id ID] [-v]``: the demo (:mod:`flows.cli`)."""

from symfuse.console import start

start("flows.cli:main")  # a Ctrl-C in the seconds of imports: one line, not a traceback
