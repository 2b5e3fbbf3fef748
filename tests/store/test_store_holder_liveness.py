"""Copies never outlive their holder's liveness: a lease or a reservation is
reclaimed only when the process holding it is gone.

  * Store.close() with a lease or reservation still open waits for it, then
    refuses (StoreInUseError) and stays attached: closing would hand the
    holder's liveness back, another process would reclaim the write, and the
    late copy would land in whatever chunk reused those bytes.
  * A forked child that cannot open a description of its own (no /proc in
    its mount namespace) shares its parent's slot lock: it takes no slot, is
    judged by its pid, and judges slots that read "free" by theirs, so it
    never reclaims its live parent's lease or write.
  * A process given a dead process's pid adopts that process's slot only
    when the slot is held and was claimed by a process started when it was:
    the dead one's lease is reclaimed, never adopted.
"""

from __future__ import annotations

import os

import pytest
from helpers import key, payload_for

from shmkv import PutResult, Store
from shmkv.errors import StoreInUseError

pytestmark = pytest.mark.slow

UNIT = 64 * 1024


def test_close_with_a_reservation_open_refuses_and_nothing_is_reclaimed(cache_name, child):
    s = Store.create(cache_name, 4 << 20, alignment=4096)
    r = s.reserve(key("late"), UNIT)
    with pytest.raises(StoreInUseError, match="1 lease"):
        s.close(timeout_s=0.2)
    assert not s.closed, "the store stays attached"
    c = child(f"""
        from shmkv import Store
        s = Store.attach({cache_name!r})
        print("reclaimed", s.reclaim()["writes"], flush=True)
        k2 = {key('other')!r}
        print("put", s.put(k2, bytes([7]) * {UNIT}).name, flush=True)
        s.close()
    """)
    assert c.expect("reclaimed") == "reclaimed 0", "the write's holder is attached: not reclaimed"
    assert c.expect("put") == "put OK"
    c.finish()
    r.view()[:] = payload_for(key("late"), UNIT)  # the late copy
    assert r.commit() is PutResult.OK
    assert s.get(key("other")) == bytes([7]) * UNIT, "the other key's bytes are intact"
    assert s.get(key("late")) == payload_for(key("late"), UNIT)
    lease = s.acquire(key("late"))
    with pytest.raises(StoreInUseError):
        s.close(timeout_s=0.1)
    lease.release()
    s.close()
    assert s.closed


FORK_WITHOUT_PROC = r"""
import ctypes, os, sys
from shmkv import Store
CLONE_NEWNS, MS_REC, MS_PRIVATE, MNT_DETACH = 0x00020000, 0x4000, 0x40000, 2
s = Store.attach({name!r})
r = s.reserve({wkey!r}, {unit})
lease = s.acquire({lkey!r})
rd, wr = os.pipe()
pid = os.fork()
if pid == 0:
    libc = ctypes.CDLL(None, use_errno=True)
    ok = libc.unshare(CLONE_NEWNS) == 0 and libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) == 0 \
        and libc.umount2(b"/proc", MNT_DETACH) == 0 and not os.path.exists("/proc/self")
    got = s.reclaim() if ok else {{"leases": -1, "writes": -1}}
    s.put({ckey!r}, b"c" * {unit})  # the child uses the store: it registers
    got2 = s.reclaim()
    os.write(wr, f"{{int(ok)}} {{got['leases'] + got2['leases']}} {{got['writes'] + got2['writes']}}".encode())
    os._exit(0)
os.waitpid(pid, 0)
print("child", os.read(rd, 100).decode(), flush=True)
r.view()[:] = b"w" * {unit}
print("commit", r.commit().name, "release", lease.release(), flush=True)
print("unshared", s.stats()["liveness_unshared"], flush=True)
"""


def test_a_forked_child_without_proc_never_reclaims_its_parent(cache_name, child):
    s = Store.create(cache_name, 4 << 20, alignment=4096)
    assert s.put(key("leased"), payload_for(key("leased"), UNIT)) is PutResult.OK
    c = child(FORK_WITHOUT_PROC.format(name=cache_name, wkey=key("written"), lkey=key("leased"),
                                       ckey=key("child"), unit=UNIT))
    ok, leases, writes = c.expect("child").split()[1:]
    assert ok == "1", "the child's mount namespace has no /proc"
    assert (leases, writes) == ("0", "0"), "the child reclaimed its live parent's lease or write"
    assert c.expect("commit") == "commit OK release True"
    assert c.expect("unshared") == "unshared 1"
    c.finish()
    assert s.get(key("written")) == b"w" * UNIT
    assert s.get(key("child")) == b"c" * UNIT
    assert s.stats()["leases_reclaimed"] == 0 and s.stats()["writes_reclaimed"] == 0
    s.close()


def _spawn_with_pid(target: int, code: str, child) -> object | None:
    """A child whose pid is `target` (ns_last_pid), or None when another fork took it."""
    for _ in range(20):
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(target - 1))
        c = child(code)
        if c.proc.pid == target:
            return c
        c.kill9()
    return None


def test_a_reused_pid_does_not_adopt_a_dead_processs_slot(cache_name, child):
    if not os.access("/proc/sys/kernel/ns_last_pid", os.W_OK):
        pytest.skip("/proc/sys/kernel/ns_last_pid is not writable here (needs root)")
    s = Store.create(cache_name, 4 << 20, alignment=4096)
    assert s.put(key("k"), payload_for(key("k"), UNIT)) is PutResult.OK
    dead = child(f"""
        import sys
        from shmkv import Store
        s = Store.attach({cache_name!r})
        lease = s.acquire({key('k')!r})
        print("leased", flush=True)
        sys.stdin.read()
    """)
    dead.expect("leased")
    pid = dead.proc.pid
    dead.kill9()
    heir = _spawn_with_pid(pid, f"""
        import os
        from shmkv import Store
        s = Store.attach({cache_name!r})
        s.put({key('heir')!r}, b"h" * {UNIT})  # registers: the dead process's slot carries this pid
        print("pid", os.getpid(), "reclaimed", s.reclaim()["leases"], flush=True)
        s.close()
    """, child)
    if heir is None:
        pytest.skip(f"pid {pid} was taken by another process before the test could reuse it")
    said = heir.expect("pid")
    heir.finish()
    assert said.startswith(f"pid {pid} ")
    assert s.stats()["leases_reclaimed"] == 1, "the dead process's lease was adopted, not reclaimed"
    assert [e["leases"] for e in s.entries() if e["key"] == key("k")] == [0]
    s.close()
