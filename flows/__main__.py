"""``python -m flows [--quick] [--config run.yaml] [--store DIR] [--run-id ID] [-v]``: the demo (:mod:`flows.cli`)."""

import sys

from flows.cli import main

sys.exit(main())
