"""Exponential backoff after failures, shared by the tiers that can fail
(the disk tier's spills, the remote tier's calls): after a failure the next
try waits 0.25 s, doubling up to 30 s; the first success resets it. Callers
log the state changes (`failed` tells whether this failure started a failing
state, `worked` how many failures it ended)."""

from __future__ import annotations

import threading
import time


class Backoff:
    FIRST_S, MAX_S = 0.25, 30.0

    def __init__(self) -> None:
        self.failures = 0  # since the last success
        self.delay_s = 0.0
        self._until = 0.0
        self._lock = threading.Lock()

    def ready(self) -> bool:
        """Whether the backoff after the last failure is over."""
        return time.monotonic() >= self._until

    def failed(self) -> bool:
        """Record a failure and start (or double) the wait; True if it is the first."""
        with self._lock:
            self.failures += 1
            self.delay_s = min(self.MAX_S, self.delay_s * 2 if self.delay_s else self.FIRST_S)
            self._until = time.monotonic() + self.delay_s
            return self.failures == 1

    def retry_now(self) -> None:
        """End the wait now (the cause is known to be gone), keeping the failure
        count: a success after it still says how many failures it ended."""
        with self._lock:
            self._until = 0.0

    def worked(self) -> int:
        """Record a success; returns how many failures it ended (0: none)."""
        if not self.failures:
            return 0
        with self._lock:
            n, self.failures, self.delay_s, self._until = self.failures, 0, 0.0, 0.0
        return n
