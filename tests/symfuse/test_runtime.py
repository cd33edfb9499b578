"""Process-level settings: glibc's mmap threshold only in a `symfuse match` process, torch threads per thread."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch


def _set_in_fresh_process(env: dict[str, str]) -> str:
    code = "from symfuse.runtime import map_large_allocations; print(map_large_allocations())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_mmap_threshold_is_set_unless_the_environment_says_otherwise():
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    assert _set_in_fresh_process(env) == "True"
    assert _set_in_fresh_process({**env, "MALLOC_MMAP_THRESHOLD_": "65536"}) == "False"  # the user's value wins


@pytest.mark.parametrize(("argv", "wanted"), [(["match", "--help"], True), (["-v", "match", "--help"], True),
                                              (["merge", "--help"], False), (["--help"], False)])  # fmt: skip
def test_only_the_match_command_maps_large_allocations(monkeypatch, argv, wanted):
    from symfuse import cli, runtime

    calls = []
    monkeypatch.setattr(runtime, "map_large_allocations", lambda: calls.append(1) or True)
    monkeypatch.setattr(sys, "argv", ["symfuse", *argv])
    with pytest.raises(SystemExit) as info:
        cli.main()
    assert info.value.code == 0 and calls == ([1] if wanted else [])


def test_torch_threads_sets_and_restores_the_count():
    from symfuse.runtime import torch_threads

    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    seen = {}
    try:
        with torch_threads(1):
            seen["inside"] = torch.get_num_threads()
        seen["after"] = torch.get_num_threads()
    finally:
        torch.set_num_threads(prev)
    assert seen["inside"] == 1 and seen["after"] == 2
