"""kill -9 at the worst moments: mid-write, holding leases, holding the lock."""

from __future__ import annotations

import os
import time

import pytest
from helpers import key, payload_for

from shmkv import PutResult, Store

pytestmark = pytest.mark.slow

UNIT = 64 * 1024


def test_writer_killed_mid_write_never_becomes_visible(cache_name, child):
    s = Store.create(cache_name, 4 << 20, alignment=4096)
    base = s.stats()["bytes_used"]
    c = child(f"""
        import sys
        from shmkv import Store
        s = Store.attach({cache_name!r})
        r = s.reserve({key('w')!r}, {UNIT})
        r.view()[: {UNIT} // 2] = b"h" * ({UNIT} // 2)   # half written
        print("writing", flush=True)
        sys.stdin.read()
    """)
    c.expect("writing")
    assert s.stats()["bytes_used"] == base + UNIT
    c.kill9()
    assert s.lookup_prefix([key("w")]) == 0 and s.get(key("w")) is None
    got = s.reclaim()
    assert got["writes"] == 1
    st = s.stats()
    assert st["bytes_used"] == base and st["writes_reclaimed"] == 1
    # the key can be written again, by anyone
    assert s.put(key("w"), payload_for(key("w"), UNIT)) is PutResult.OK
    assert s.get(key("w")) == payload_for(key("w"), UNIT)
    assert s.check_consistency() == []
    s.close()


def test_dead_writers_bytes_come_back_when_the_store_fills(cache_name, child):
    s = Store.create(cache_name, 2 << 20, alignment=UNIT, max_entries=64)
    units = s.arena_bytes // UNIT
    c = child(f"""
        import sys
        from shmkv import Store
        s = Store.attach({cache_name!r})
        rs = [s.reserve(bytes([i]) * 16, {UNIT}) for i in range({units})]
        print("reserved", sum(1 for r in rs if not isinstance(r, int)), flush=True)
        sys.stdin.read()
    """)
    c.expect("reserved")
    assert s.put(key("x"), b"x" * UNIT) is PutResult.FULL
    c.kill9()
    # no explicit reclaim: the allocation that would fail reclaims by itself
    for i in range(units):
        assert s.put(key(i), payload_for(key(i), UNIT)) is PutResult.OK
    assert s.stats()["writes_reclaimed"] == units
    assert s.check_consistency() == []
    s.close()


def test_reader_killed_holding_leases_gets_them_reclaimed(cache_name, child):
    s = Store.create(cache_name, 2 << 20, alignment=UNIT, max_entries=64)
    units = s.arena_bytes // UNIT
    for i in range(units):
        assert s.put(key(i), payload_for(key(i), UNIT)) is PutResult.OK
    keys = [key(i) for i in range(units)]
    c = child(f"""
        import sys
        from shmkv import Store
        s = Store.attach({cache_name!r})
        leases = s.acquire_prefix({keys!r})
        print("leased", len(leases), flush=True)
        sys.stdin.read()
    """)
    assert c.expect("leased") == f"leased {units}"
    assert s.stats()["leases_held"] == units
    assert s.put(key("new"), b"n" * UNIT) is PutResult.FULL
    c.kill9()
    # the table can be filled to the cap again with new chunks
    for i in range(units, 2 * units):
        assert s.put(key(i), payload_for(key(i), UNIT)) is PutResult.OK
    st = s.stats()
    assert st["leases_held"] == 0 and st["leases_reclaimed"] == units
    assert st["bytes_used"] == units * UNIT == s.arena_bytes // UNIT * UNIT
    assert s.check_consistency() == []
    s.close()


@pytest.mark.parametrize("scramble", [False, True], ids=["clean", "half-changed"])
def test_process_killed_holding_the_lock(cache_name, child, scramble):
    s = Store.create(cache_name, 4 << 20, alignment=4096)
    for i in range(50):
        s.put(key(i), payload_for(key(i), 3000 + i))
    lease = s.acquire(key(0))
    c = child(f"""
        import os
        from shmkv import Store
        s = Store.attach({cache_name!r})
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            s.table.debug_die_holding_lock(w, {scramble})
        os.read(r, 1)                  # the grandchild now holds the lock
        print("locked", pid, flush=True)
        os.waitpid(pid, 0)
    """)
    holder = int(c.expect("locked").split()[1])
    os.kill(holder, 9)
    t0 = time.monotonic()
    assert s.get(key(1)) == payload_for(key(1), 3001)
    waited = time.monotonic() - t0
    assert waited < 1.0, f"survivor waited {waited:.3f}s for a dead lock holder"
    st = s.stats()
    assert st["lock_recoveries"] == 1 and st["segment_resets"] == 0
    assert s.check_consistency() == []
    for i in range(50):
        assert s.get(key(i)) == payload_for(key(i), 3000 + i)
    assert lease.release(), "a live process's lease survives the recovery"
    for i in range(50, 200):
        assert s.put(key(i), payload_for(key(i), 3000)) is PutResult.OK
    assert s.check_consistency() == []
    c.finish()
    s.close()
