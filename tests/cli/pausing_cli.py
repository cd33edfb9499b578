"""``python -m tests.cli.pausing_cli MARKER ARGS...``: ``symfuse ARGS`` that pauses in the middle of its write.

After the first weight shard is written into the temporary output folder, the process writes MARKER (holding
the temporary folder's path) and sleeps, so that a test can kill it at a known point: half an artifact on disk,
the output lock held. Only this test wrapper patches anything; the command itself is the real one.
"""

import sys
import time
from pathlib import Path

import symfuse.checkpoint
from symfuse.cli import main

# the function write_checkpoint writes each shard with
_SAVE = "save_safetensors" if hasattr(symfuse.checkpoint, "save_safetensors") else "save_file"
_save = getattr(symfuse.checkpoint, _SAVE)


def _save_then_pause(tensors, filename, metadata=None):
    _save(tensors, filename, metadata=metadata)
    Path(MARKER).write_text(str(Path(filename).parent))
    time.sleep(600)


if __name__ == "__main__":
    MARKER = sys.argv.pop(1)
    setattr(symfuse.checkpoint, _SAVE, _save_then_pause)
    main()
