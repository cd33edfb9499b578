"""Console hygiene: keep transformers / huggingface_hub / datasets to what a user of symfuse needs.

Every checkpoint load otherwise prints a load report ("classifier.bias | MISSING", "Some weights of ... were not
initialized") and a "Loading weights" progress bar, and every dataset load "Generating train split" / "Map" bars; a
pipeline loads dozens of checkpoints, so these drown its own progress and the final table.
:func:`quiet_third_party` is called by the entry points (the ``symfuse`` CLI unless ``-v``, the demo, the flows);
library code itself only logs.
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger(__name__)

# Environment switches the libraries read when imported (and worker subprocesses inherit).
QUIET_ENV = {
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_VERBOSITY": "error",
    "DATASETS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
}


def quiet_third_party(verbose: bool = False) -> dict[str, str]:
    """Third-party libraries log errors only and show no progress bars; a value the user set in the environment wins.

    Sets the switches of :data:`QUIET_ENV` that are not set yet (for libraries imported later) and applies the same
    settings through the APIs of those already imported. Idempotent; cheap (imports nothing).

    Args:
        verbose: Leave everything as it is (``-v``: the load reports and bars are shown).

    Returns:
        The environment switches this call set (empty when ``verbose`` or all were set already).
    """
    if verbose:
        return {}
    added = {k: v for k, v in QUIET_ENV.items() if k not in os.environ}
    os.environ.update(added)

    def ours(var: str) -> bool:
        return os.environ.get(var) == QUIET_ENV[var]

    if "transformers" in sys.modules:
        from transformers.utils import logging as tf_logging

        if ours("TRANSFORMERS_VERBOSITY"):
            tf_logging.set_verbosity_error()
        if ours("HF_HUB_DISABLE_PROGRESS_BARS"):
            tf_logging.disable_progress_bar()
    if "huggingface_hub" in sys.modules:
        from huggingface_hub import utils as hub_utils

        if ours("HF_HUB_VERBOSITY"):
            hub_utils.logging.set_verbosity_error()
        if ours("HF_HUB_DISABLE_PROGRESS_BARS"):
            hub_utils.disable_progress_bars()
    if "datasets" in sys.modules:
        import datasets

        if ours("DATASETS_VERBOSITY"):
            datasets.logging.set_verbosity_error()
        if ours("HF_DATASETS_DISABLE_PROGRESS_BARS"):
            datasets.disable_progress_bars()
    log.debug("third-party logs quieted (%s)", added or "already")
    return added
