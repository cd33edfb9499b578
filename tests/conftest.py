"""Every test: downloads of remote artifacts go to a folder of this session, never to the user's own cache."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _session_artifact_cache(tmp_path_factory):
    """``SYMFUSE_CACHE`` set for the whole session (subprocesses inherit it); tests may still point it elsewhere."""
    previous = os.environ.get("SYMFUSE_CACHE")
    os.environ["SYMFUSE_CACHE"] = str(tmp_path_factory.mktemp("artifact-cache"))
    yield
    if previous is None:
        os.environ.pop("SYMFUSE_CACHE", None)
    else:
        os.environ["SYMFUSE_CACHE"] = previous
