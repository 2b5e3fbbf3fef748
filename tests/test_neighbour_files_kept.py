"""A test run removes only what it made (#67): a neighbour started outside
the run, making vLLM's kinds of files (a named semaphore, a message queue) in
the run's last moments and starting a worker that opens them by name after
the run ended, keeps working; the run still leaves /dev/shm as it found it,
its own killed engine's files removed by ownership. The neighbour's engine
directory in the run's temporary directory, the segment it maps and that
cache's files and a weights board in the runtime directory are named as in
use, not counted against the run (a run beside `bench churn` failed on
them). (The run that removed
every new sem.mp-* at its end, by name and time, broke exactly this: a
neighbour's `vllm serve` died at start in SemLock._rebuild.)

The run is a nested pytest session with the suite's leftovers plugin, in a
mount namespace with a /dev/shm of its own (root: unshare), so the other
xdist worker's files do not enter its count (tests/support/neighbour_run.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

DRIVER = os.path.join(os.path.dirname(__file__), "support", "neighbour_run.py")


def test_a_neighbours_files_survive_the_run_and_the_run_leaves_nothing(model_dir, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root for a mount namespace with a /dev/shm of its own (unshare)")
    workdir = tmp_path / "run"
    workdir.mkdir()
    cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
           'mount -t tmpfs -o size=512m,mode=1777 neighbour-test-shm /dev/shm && exec "$@"', "sh",
           sys.executable, DRIVER, str(workdir), model_dir]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["run_exit"] == 0, got["run_tail"]
    files = got["neighbour_files"]
    assert files["sem"].startswith("sem.mp-") and files["psm"].startswith("psm_")
    assert "in use by live processes" in got["run_tail"], "the run named the neighbour's files as in use"
    theirs = {files["sem"], files["psm"], files["segment"]}
    assert theirs <= set(got["shm_after_run"]), "the run removed the neighbour's files"
    assert got["worker"] == {"worker_read": 42, "worker_exit": 0}, "the neighbour's worker opened them by name"
    assert set(got["shm_after_run"]) - set(got["shm_before"]) == theirs, \
        "the run left /dev/shm as it found it, the neighbour's files aside"
    assert got["shm_at_end"] == got["shm_before"], "the neighbour removed its own at its end"
    assert [n for n in got["left_in_tmp"] if not n.startswith("pytest-of-")] == [files["engine_tmp"]], \
        "nothing of the run's in the temporary directory; the neighbour's engine directory kept"
    assert set(files["runtime_files"]) <= set(got["runtime_after_run"]), "the neighbour's runtime files kept"
    named = got["run_tail"].split("in use by live processes, not this run's to remove: ", 1)[1].splitlines()[0]
    for n in (files["engine_tmp"], files["segment"], *files["runtime_files"]):
        assert n in named, (n, named)
    assert "LEFT BEHIND" not in got["run_tail"], got["run_tail"]
