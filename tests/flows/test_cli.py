"""The demo's command line: a bad config or a failed run ends with ONE error line and a non-zero exit."""

from __future__ import annotations

import logging

import pytest

from flows.cli import _NoTraceback, main
from tests.flows.conftest import tiny_config


@pytest.fixture
def console_formatters():
    """Restore every handler's formatter afterwards (the command hides tracebacks on the console)."""
    handlers = [h for lg in (logging.getLogger(), *logging.Logger.manager.loggerDict.values())
                if isinstance(lg, logging.Logger) for h in lg.handlers]  # fmt: skip
    saved = [(h, h.formatter) for h in handlers]
    yield
    for h, f in saved:
        h.setFormatter(f)


def test_a_bad_config_is_one_line_naming_the_file(tmp_path, capfd):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("run_id: x\nstrategies: [simpel]\n")
    assert main(["--config", str(cfg)]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {cfg}: ") and "simpel" in err[0], err
    assert main(["--config", str(tmp_path / "missing.yaml")]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "missing.yaml" in err[0]


def test_a_failed_run_is_one_error_line_and_no_traceback(tiny_base, memory_root, tmp_path, capfd, console_formatters):
    config = tiny_config(tiny_base, memory_root, run_id="cli-fails", strategies=["simple"], anchor="closest",
                         datasets=[{"name": "nosuch", "source": "/nonexistent/no_such_dataset.jsonl"}])  # fmt: skip
    cfg = tmp_path / "run.yaml"
    config.to_yaml(cfg)
    assert main(["--config", str(cfg)]) == 1
    out = capfd.readouterr()
    text = out.out + out.err
    assert "Traceback" not in text
    last = out.err.strip().splitlines()[-1]
    assert last.startswith("error: ") and "no_such_dataset" in last, last
    # the console handlers now drop tracebacks; a record's traceback still reaches other handlers
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", None, __import__("sys").exc_info())
    assert "boom" not in _NoTraceback(logging.Formatter()).format(record)
    assert "boom" in logging.Formatter().format(record)
