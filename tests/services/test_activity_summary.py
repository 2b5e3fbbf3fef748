"""Activity summaries: per-request lines are DEBUG; one INFO line per
interval sums what happened since the last one, and nothing is written
before the interval has passed or when nothing happened."""

from __future__ import annotations

import logging

from shmkv.activity import ActivitySummary


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_one_line_per_interval_with_the_sums(caplog):
    clock = Clock()
    log = logging.getLogger("test.activity")
    a = ActivitySummary(log, 60, lambda c, s: f"{s:.0f}s req={c['requests']} tok={c['tokens']}", clock)
    with caplog.at_level(logging.INFO, logger="test.activity"):
        a.add(requests=1, tokens=100)
        clock.t += 30
        a.add(requests=1, tokens=50)
        assert caplog.messages == [], "not before the interval has passed"
        clock.t += 31
        a.add(requests=1, tokens=0)
        assert caplog.messages == ["61s req=3 tok=150"]
        clock.t += 61
        a.maybe_emit()
        assert len(caplog.messages) == 1, "an interval with nothing to say writes nothing"
        a.add(requests=2, tokens=7)
        clock.t += 60
        a.maybe_emit()
        assert caplog.messages[-1] == "60s req=2 tok=7", "the counts start again after each line"


def test_zero_interval_writes_nothing(caplog):
    clock = Clock()
    a = ActivitySummary(logging.getLogger("test.activity0"), 0, lambda c, s: "line", clock)
    with caplog.at_level(logging.INFO, logger="test.activity0"):
        for _ in range(3):
            a.add(requests=1)
            clock.t += 1000
    assert caplog.messages == []
