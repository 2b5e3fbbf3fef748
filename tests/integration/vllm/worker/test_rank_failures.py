"""The TP ranks of one engine tell each other which requests' loads failed
(#63 item 4, rank_failures.py): a request one rank marks is marked for every
rank mapping the engine's file (another process), a request nobody marked is
not, marks of another engine are not seen, and a finished request leaves
the process's memo while the ring keeps it for SLOTS marks. End to end at
TP = 2: test_vllm_tp_load_failure.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from shmkv.integration.vllm.rank_failures import SLOTS, RankFailures


@pytest.fixture(autouse=True)
def _private_runtime_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SHMKV_RUNTIME_DIR", str(tmp_path / "runtime"))


def test_a_mark_reaches_every_rank_of_the_engine_only(tmp_path):
    rank0, other_engine = RankFailures("engine-a"), RankFailures("engine-b")
    code = ("import sys; from shmkv.integration.vllm.rank_failures import RankFailures; "
            "RankFailures('engine-a').mark(['req-7'])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert rank0.marked("req-7"), "rank 1 (another process) marked it"
    assert not rank0.marked("req-8") and not other_engine.marked("req-7")
    rank0.forget(["req-7"])
    assert rank0.marked("req-7"), "the ring still holds it"


def test_the_ring_forgets_only_after_slots_marks():
    f = RankFailures("engine-c")
    f.mark(["first"])
    f.mark([f"r{i}" for i in range(SLOTS - 1)])
    f.forget(["first"])
    assert f.marked("first")
    f.mark(["one-more"])
    f.forget(["first"])
    assert not f.marked("first"), "SLOTS marks later its slot was reused"
