"""``python -m tests.cli.pausing_cli MARKER ARGS...``: ``symfuse ARGS`` that pauses in the middle of its write.

After the first planned weight shard is finished in the temporary output folder, the process writes MARKER
(holding the temporary folder's path) and sleeps, so that a test can kill it at a known point: half an artifact
on disk, the output lock held. Only this test wrapper patches anything; the command itself is the real one.
"""

import sys
import time
from pathlib import Path

import symfuse.io.planned
from symfuse.cli import main

# every checkpoint write fills planned shards in place (symfuse.io.planned): pause once the first is finished
_finish = symfuse.io.planned.PlannedFile.finish


def _finish_then_pause(self):
    out = _finish(self)
    Path(MARKER).write_text(str(Path(out).parent))
    time.sleep(600)


if __name__ == "__main__":
    MARKER = sys.argv.pop(1)
    symfuse.io.planned.PlannedFile.finish = _finish_then_pause
    main()
