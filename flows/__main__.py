"""``python -m flows [--quick] [--config run.yaml]``: the same demo as ``python -m flows.pipeline``."""

import sys

from flows.cli import main

sys.exit(main())
