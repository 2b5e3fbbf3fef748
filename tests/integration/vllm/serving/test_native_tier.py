"""shmkv as a secondary tier of vLLM's native offloading, driven through vLLM's
own TieringOffloadingManager (tests/native_tier_driver.py, one process per
engine, no model; shmkv/bench/native_tier.py): what engine A stores, engine B (another process, another
engine id) finds and loads byte-equal; another model, dtype, parallel layout
or block size misses; chunks pushed out to disk come back; eight engines
storing the same keys leave one copy; a killed engine leaves nothing partial
and no lease; a bad option names itself. shmkv and vLLM on their defaults,
except the tier entry."""

from __future__ import annotations

import json
import os
import signal

import pytest
from helpers import REPO, segment_stat, wait_until

from shmkv import Store
from shmkv.engines.forks import ForkedProcess, fork_module

pytestmark = pytest.mark.slow

def start(role: str, **params) -> ForkedProcess:
    """`python -m shmkv.bench.native_tier ROLE JSON`, forked from a server that
    imported vLLM once (one engine's process each, without its import cost)."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return fork_module("shmkv.bench.native_tier", [role, json.dumps(params)], env)


def finish(proc: ForkedProcess) -> dict:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    line = next(ln for ln in out.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def drive(role: str, **params) -> dict:
    return finish(start(role, **params))


def test_a_second_engine_loads_what_the_first_stored_byte_equal(cache_name):
    a = drive("store", cache=cache_name, engine="A", chunks=64)
    assert a["stored"] == 64 and not a["pending"], "every cascade finished"
    b = drive("load", cache=cache_name, engine="B", chunks=64)
    assert b["hits"] == 64 and b["equal"], "B's primary view holds A's bytes exactly"
    store = Store.attach(cache_name)
    try:
        st = store.stats()
        assert st["entries"] == 64 and st["leases_held"] == 0
        assert st["put_tokens"] == 64 * 256, "each chunk counts its tokens like the connector's"
    finally:
        store.close()


@pytest.mark.parametrize("change", [{"model": "another-model"}, {"dtype": "float16"}, {"world": 2}, {"block": 32}],
                         ids=["model", "dtype", "parallel", "block-size"])
def test_another_configuration_misses_every_chunk(cache_name, change):
    drive("store", cache=cache_name, engine="A", chunks=8)
    b = drive("load", cache=cache_name, engine="B", chunks=8, **change)
    assert b["hits"] == 0 and b["results"] == ["MISS"]


def test_chunks_pushed_out_to_disk_come_back_byte_equal(cache_name, tmp_path):
    from shmkv.services.maintainer import Maintainer
    from shmkv.tiers import TierChain
    from shmkv.tiers.disk.tier import DiskTier

    disk = str(tmp_path / "disk")
    drive("store", cache=cache_name, engine="A", chunks=32, tier={"disk_dir": disk})
    store = Store.attach(cache_name)
    try:
        tier = DiskTier(os.path.join(disk, cache_name), capacity_bytes=1 << 30)
        _spilled, left = Maintainer(TierChain(store, [tier])).spill_all()  # engine A's maintainer may have begun
        assert left == 0 and len([e for e in store.entries() if e["state"] == "ready"]) == 32
        assert all(tier.contains([e["key"] for e in store.entries()]))
        store.clear()  # the shared tier forgets them: only the disk holds them now
        assert store.stats()["entries"] == 0
    finally:
        store.close()
    b = drive("load", cache=cache_name, engine="B", chunks=32, tier={"disk_dir": disk})
    assert b["hits"] == 32 and b["equal"], "promoted from disk, then loaded"


def test_eight_engines_storing_the_same_keys_leave_one_copy(cache_name):
    procs = [start("store", cache=cache_name, engine=f"E{i}", chunks=32) for i in range(8)]
    results = [finish(p) for p in procs]
    assert all(r["stored"] == 32 and not r["pending"] for r in results)
    store = Store.attach(cache_name)
    try:
        st = store.stats()
        assert st["entries"] == 32 and st["leases_held"] == 0
        assert st["puts"] == 32, "one copy of each chunk was written; the other engines found it there"
    finally:
        store.close()
    assert drive("load", cache=cache_name, engine="B", chunks=32)["equal"]


def test_an_engine_killed_while_its_cascade_runs_leaves_nothing_partial(cache_name):
    # endless: engine A stores round after round until killed, so the kill always lands mid-cascade
    a = start("store", cache=cache_name, engine="A", chunks=256, step_s=0.0, endless=True)
    wait_until(lambda: os.path.exists(f"/dev/shm/{cache_name}") and _puts(cache_name) >= 64,
               "engine A's cascade under way")
    if a.poll() is not None:
        _, err = a.communicate(timeout=60)
        pytest.fail(f"engine A exited ({a.returncode}) before it was killed: {err[-2000:]}")
    assert a.signal_group(signal.SIGKILL)
    assert a.wait() == -signal.SIGKILL
    store = Store.attach(cache_name)
    try:
        store.reclaim()  # what the survivors (or the daemon) do for a dead process
        st = store.stats()
        assert st["leases_held"] == 0 and st["entries"] == st["ready_entries"], "no lease or half-written chunk left"
        held = st["entries"]
    finally:
        store.close()
    b = drive("load", cache=cache_name, engine="B", chunks=256)
    assert b["equal"], "every chunk B loads is whole"
    assert b["hits"] <= held


def _puts(cache: str) -> int:
    return segment_stat(cache, "puts")


def test_a_bad_option_in_the_tier_entry_names_it(cache_name):
    p = start("store", cache=cache_name, engine="A", chunks=1, tier={"capacity": "lots"})
    out, err = p.communicate(timeout=300)
    assert p.returncode != 0
    lines = [ln for ln in err.splitlines() if "capacity" in ln and "lots" in ln]
    assert lines, err[-2000:]
    assert "secondary tier" in lines[-1]
