"""The one rule for names that become part of artifact keys: run ids, datasets, models, kinds, strategies, modules.

A name is a single folder of a store key (:mod:`symfuse.store.layout`) and a run-config field
(:mod:`symfuse.config_schema`); both read the rule here, so the form, the config and the store agree. It imports
nothing of the library (no fsspec), so the config can use it.
"""

from __future__ import annotations

import re

NAME_MAX = 100  # with the prefixes and suffixes keys add, a key's folder stays under the 255 bytes of a file name
NAME_CHARS = "letters, digits and ._@+=-"
NAME_RE = re.compile(rf"^[A-Za-z0-9][A-Za-z0-9._@+=-]{{0,{NAME_MAX - 1}}}$")


def is_name(value: object) -> bool:
    """Whether ``value`` is a string of 1-``NAME_MAX`` :data:`NAME_CHARS` that starts with a letter or digit."""
    return isinstance(value, str) and NAME_RE.match(value) is not None
