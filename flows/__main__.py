"""``python -m flows [--quick] [--config run.yaml] [--store DIR] [--run-id ID] [-v]``: the demo (:mod:`flows.cli`)."""

import sys

try:
    from flows.cli import main
except KeyboardInterrupt:  # a Ctrl-C in the seconds of imports: one line, not a traceback
    from symfuse.errors import INTERRUPTED_STARTING

    print(INTERRUPTED_STARTING, file=sys.stderr)
    sys.exit(130)
sys.exit(main())
