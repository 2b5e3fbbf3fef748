"""Activity summaries: what a process did since its last summary, as one INFO
line every `log_summary_s` seconds (per-request lines are DEBUG, so a busy
server's log stays readable). No thread: the line is written by the first
event after the interval has passed."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable


class ActivitySummary:
    """Counts events and writes them as one line per interval."""

    def __init__(self, log: logging.Logger, interval_s: float, render: Callable[[Counter, float], str],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log = log
        self.interval_s = interval_s
        self.render = render  # (counts, seconds covered) -> the line
        self.clock = clock
        self.counts: Counter[str] = Counter()
        self.since = clock()

    def add(self, **counts: float) -> None:
        """Count events, then write the summary if the interval has passed."""
        self.counts.update({k: v for k, v in counts.items() if v})
        self.maybe_emit()

    def maybe_emit(self) -> None:
        if self.interval_s <= 0:
            return
        now = self.clock()
        if now - self.since < self.interval_s:
            return
        if self.counts:
            self.log.info(self.render(self.counts, now - self.since))
        self.counts = Counter()
        self.since = now
