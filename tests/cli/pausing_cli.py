"""``python -m tests.cli.pausing_cli MARKER ARGS...``: ``symfuse ARGS`` that pauses in the middle of its write.

After the first weight shard is written into the temporary output folder (or, for ``match``, the first planned
shard is finished), the process writes MARKER (holding
the temporary folder's path) and sleeps, so that a test can kill it at a known point: half an artifact on disk,
the output lock held. Only this test wrapper patches anything; the command itself is the real one.
"""

import sys
import time
from pathlib import Path

import symfuse.checkpoint
import symfuse.io.planned
from symfuse.cli import main

# the function write_checkpoint writes each shard with
_SAVE = "save_safetensors" if hasattr(symfuse.checkpoint, "save_safetensors") else "save_file"
_save = getattr(symfuse.checkpoint, _SAVE)


def _save_then_pause(tensors, filename, metadata=None):
    _save(tensors, filename, metadata=metadata)
    Path(MARKER).write_text(str(Path(filename).parent))
    time.sleep(600)


# ``symfuse match`` fills planned shards in place (symfuse.io.planned) instead: pause once the first is finished
_finish = symfuse.io.planned.PlannedFile.finish


def _finish_then_pause(self):
    out = _finish(self)
    Path(MARKER).write_text(str(Path(out).parent))
    time.sleep(600)


if __name__ == "__main__":
    MARKER = sys.argv.pop(1)
    setattr(symfuse.checkpoint, _SAVE, _save_then_pause)
    symfuse.io.planned.PlannedFile.finish = _finish_then_pause
    main()
