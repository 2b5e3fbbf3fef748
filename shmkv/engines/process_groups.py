"""Ending the process group of a child a benchmark started (an engine, a
`vllm serve`, a server), without signalling a pid that may be another's.

A child is started as its own session (start_new_session), so its pid is
its group id while it is not reaped. These helpers signal the group only
while the leader is unreaped: pids wrap at 32768 on these hosts and vLLM
starts hundreds of threads, so a reaped pid may be another process's.

A handle other than a Popen (a test's forked child, whose parent is another
process) brings its own `signal_group(sig) -> bool` and
`wait_exited(timeout) -> bool`; these helpers use them when it has them.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any


def signal_group(proc: Any, sig: int) -> bool:
    """Signal the process group of `proc` only while its leader is not
    reaped. Whether it was signalled."""
    own = getattr(proc, "signal_group", None)
    if own is not None:
        return bool(own(sig))
    if proc.returncode is not None:  # Popen reaped it
        return False
    try:
        os.killpg(proc.pid, sig)
        return True
    except ProcessLookupError:
        return False


def wait_exited(proc: Any, timeout: float) -> bool:
    """Wait up to `timeout` s for `proc`'s leader to exit, leaving a Popen's
    unreaped (its group id stays its own for signal_group). Whether it exited."""
    own = getattr(proc, "wait_exited", None)
    if own is not None:
        return bool(own(timeout))
    if proc.returncode is not None:
        return True
    deadline = time.monotonic() + timeout
    while os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is None:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def end_group(proc: Any, timeout: float = 60.0, first: int | None = signal.SIGTERM) -> int:
    """Signal `proc`'s group with `first` (None: nothing; it is already ending),
    wait up to `timeout` s for its leader, SIGKILL what is left of the group,
    reap the leader; its exit code."""
    if first is not None:
        signal_group(proc, first)
    wait_exited(proc, timeout)
    signal_group(proc, signal.SIGKILL)  # children left behind (a forked child's server does it at reaping)
    return proc.wait()
