"""A tracked pass over batches: every batch yielded, progress within its share of the job, ~10 log lines."""

import logging

import pytest

from symfuse.data import tracked_batches


def test_a_pass_reports_its_share_of_the_job_and_logs_about_ten_lines(caplog):
    seen = []
    mine = logging.getLogger("symfuse.stats.collect")  # the caller's: a run's log names the stage
    with caplog.at_level(logging.INFO, logger="symfuse.stats.collect"):
        out = list(tracked_batches(iter(range(25)), 25, "gram statistics", seen.append, 0.5, 0.5, mine))
    assert out == list(range(25))
    assert seen == sorted(seen) and len(seen) == 25
    assert seen[0] == pytest.approx(0.52) and seen[-1] == pytest.approx(1.0)
    lines = [r.getMessage() for r in caplog.records if r.name == "symfuse.stats.collect"]
    assert 10 <= len(lines) <= 13 and lines[-1] == "gram statistics: batch 25/25", lines


def test_more_batches_than_announced_never_report_past_the_share():
    seen = []
    list(tracked_batches(range(6), 4, "votes", seen.append, start=0.25, share=0.5))
    assert max(seen) == pytest.approx(0.75)


def test_a_callback_that_raises_stops_the_pass_after_the_batch():
    def stop(fraction):
        raise KeyboardInterrupt

    taken = []
    with pytest.raises(KeyboardInterrupt):
        for batch in tracked_batches(range(5), 5, "evaluate", stop):
            taken.append(batch)
    assert taken == [0]
