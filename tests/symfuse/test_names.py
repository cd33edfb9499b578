"""One naming rule: what the run config accepts as a name is exactly what can be a folder of an artifact key."""

import pytest

from symfuse.config import RunConfig
from symfuse.store import layout

CASES = [
    ("sst2", True),
    ("run-1.b@x+y=z_2", True),
    ("a" * 100, True),
    ("a" * 101, False),
    ("", False),
    ("-lead", False),
    (".hidden", False),
    ("a/b", False),
    ("a b", False),
    ("naïve", False),
]


@pytest.mark.parametrize(("name", "ok"), CASES)
def test_config_and_store_keys_share_one_name_rule(name, ok):
    def config_accepts() -> bool:
        try:
            RunConfig.demo(quick=True, run_id=name)
        except ValueError:
            return False
        return True

    def store_accepts() -> bool:
        try:
            layout.run_prefix(name)
        except ValueError:
            return False
        return True

    assert config_accepts() is ok
    assert store_accepts() is ok
