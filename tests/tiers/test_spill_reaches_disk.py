"""What RAM evicts reaches the disk: a writer puts four times the shared
tier's capacity while the maintainer spills with its default passes; every
committed chunk is then in memory or on disk (none lost). Unpaced, what the
disk could not keep up with is refused at put time and counted
(put_spill_behind), never evicted unspilled; at a pace the disk keeps, more
than memory holds is committed."""

from __future__ import annotations

import pytest

from shmkv.bench.spill_bench import run_pace

pytestmark = pytest.mark.slow


def test_an_unpaced_writer_loses_nothing_committed(tmp_path):
    r = run_pace(0, chunks=96, chunk_mib=1, capacity_mib=24, threads=2, guard=True, workdir=str(tmp_path))
    assert r["committed"] + r["refused"] == 96
    assert r["lost"] == 0 and r["evicted_unspilled"] == 0
    assert r["in_memory"] + r["on_disk"] == r["committed"]
    assert r["refused"] == r["put_spill_behind"]


def test_a_writer_the_disk_keeps_up_with_commits_more_than_memory_holds(tmp_path):
    r = run_pace(40, chunks=72, chunk_mib=1, capacity_mib=24, threads=2, guard=True, workdir=str(tmp_path))
    assert r["lost"] == 0 and r["evicted_unspilled"] == 0
    assert r["committed"] > 24 and r["on_disk"] > 0, "the disk took what memory could not hold"
    assert r["in_memory"] + r["on_disk"] == r["committed"]
