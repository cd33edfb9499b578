"""Progress bars of the command line: drawn on a terminal only, with the log lines printed above them.

The library's loops draw tqdm bars when stderr is a terminal (``progress=True``); written to a file or a pipe (CI, a
pool's logs) a command prints its log lines only. Inside :func:`terminal_bars` a log line clears the bar, prints,
and the bar is redrawn below it, so the two never share a line.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def terminal_bars() -> Iterator[bool]:
    """Route the console's log lines through tqdm while stderr is a terminal; yields whether it is one."""
    if not sys.stderr.isatty():
        yield False
        return
    from tqdm.contrib.logging import logging_redirect_tqdm

    with logging_redirect_tqdm():
        yield True


@contextlib.contextmanager
def fraction_bar(what: str) -> Iterator[Callable[[float], None]]:
    """A callback taking the fraction done (0..1), drawn as a bar named ``what`` on a terminal (else a no-op)."""
    with terminal_bars() as shown:
        if not shown:
            yield lambda fraction: None
            return
        from tqdm.auto import tqdm

        with tqdm(total=100, desc=what, leave=False, bar_format="{l_bar}{bar}| {elapsed}") as bar:
            yield lambda fraction: bar.update(max(0, round(100 * fraction) - bar.n))
