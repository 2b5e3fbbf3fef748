"""A process that holds the table lock and is stopped (SIGSTOP, a debugger, a
frozen container) must not hang anyone else: lookups answer "miss", puts
"busy", single-key management "timed out", whole-table operations raise
LockTimeoutError naming the holder, commits and releases are deferred and
happen once the lock is free, stats names the holder, the controller answers
503. A mutex of garbage in a live segment is an error, not a hang."""

from __future__ import annotations

import mmap
import os
import signal

import pytest
from helpers import key, lock_holder_code, payload_for

from shmkv import _C, PutResult, Store
from shmkv.config import load_config
from shmkv.errors import LockTimeoutError, SegmentCorruptError
from shmkv.services.controller import Controller
from shmkv.tiers import TierChain

BOUND = 0.2



@pytest.fixture
def stopped_holder(cache_name, child):
    """(the store, the pid of a stopped process holding the table lock)."""
    store = Store.create(cache_name, 8 << 20, populate=False, lock_timeout_s=BOUND)
    store.put(key(0), payload_for(key(0), 4096))
    lease = store.acquire(key(0))
    r = store.reserve(key(1), 4096)
    r.view()[:] = payload_for(key(1), 4096)
    c = child(lock_holder_code(cache_name))
    c.expect("held")
    pid, held = store.lock_holder()
    assert pid not in (0, os.getpid(), c.proc.pid), "the forked grandchild holds it"
    os.kill(pid, signal.SIGSTOP)
    store.holder_child = c  # reaps the holder: its exit means the holder is gone
    yield store, pid, lease, r
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    c.proc.wait(timeout=30)


def test_others_get_ordinary_answers_within_the_bound(stopped_holder):
    store, pid, lease, r = stopped_holder
    before = store.stats()["lock_timeouts"]
    assert store.lookup_prefix([key(0)]) == 0, "a miss, not a hang"
    assert store.acquire(key(0)) is None
    assert store.contains([key(0)]) == [False]
    assert store.put(key(2), b"x" * 4096) is PutResult.BUSY
    assert store.reserve(key(3), 4096) is PutResult.BUSY
    assert store.pin(key(0)) is False and store.delete(key(0)) is False
    with pytest.raises(LockTimeoutError, match=f"held by pid {pid}"):
        store.clear()
    with pytest.raises(LockTimeoutError, match=f"held by pid {pid}"):
        store.reclaim()
    st = store.stats()  # never waits for the lock
    assert st["lock_holder_pid"] == pid and st["lock_held_ms"] >= 0
    assert st["lock_timeouts"] >= before + 8


def test_commit_and_release_are_deferred_not_lost(stopped_holder):
    store, pid, lease, r = stopped_holder
    assert lease.release() is True, "the bytes were read under a lease that is still held"
    assert r.commit() is PutResult.OK
    assert store.stats()["deferred_ops"] == 2
    os.kill(pid, signal.SIGKILL)  # the holder dies (SIGKILL ends a stopped process too)
    store.holder_child.proc.wait(timeout=30)  # returns once the holder is reaped (its robust lock released)
    assert store.get(key(1)) == payload_for(key(1), 4096), "the deferred commit happened"
    st = store.stats()
    assert st["leases_held"] == 0, "the deferred release happened"
    assert st["lock_recoveries"] == 1 and st["lock_holder_pid"] == 0
    assert store.check_consistency() == []


def test_controller_answers_503_naming_the_holder(stopped_holder, tmp_path):
    store, pid, _lease, _r = stopped_holder
    cfg = load_config({"cache_name": store.name, "lock_timeout": BOUND}, env={})
    ctl = Controller(cfg, store, None)
    status, _ctype, body = ctl.handle("POST", "/lookup", b'{"tokens": [1, 2], "namespace": "' + b"00" * 16 + b'"}')
    assert status == 503 and f"pid {pid}".encode() in body
    status, _ctype, body = ctl.handle("POST", "/clear", b"{}")
    assert status == 503
    status, _ctype, _body = ctl.handle("GET", "/health", b"")
    assert status == 200, "health and stats never wait for the table lock"


def test_a_garbage_mutex_in_a_live_segment_is_an_error(cache_name):
    store = Store.create(cache_name, 8 << 20, populate=False, lock_timeout_s=BOUND)
    store.put(key(0), b"y" * 4096)
    off = _C.LAYOUT_OFFSETS["lock"]
    fd = os.open(f"/dev/shm/{cache_name}", os.O_RDWR)
    try:
        with mmap.mmap(fd, 4096) as m:
            m[off:off + 40] = b"\x41" * 40  # the owner "thread" 0x01414141 does not exist
    finally:
        os.close(fd)
    with pytest.raises(SegmentCorruptError, match="table lock is unusable"):
        store.clear()
    with pytest.raises(SegmentCorruptError):
        store.lookup_prefix([key(0)])


def test_the_maintainer_pauses_with_one_log_line(stopped_holder, caplog):
    import logging
    import time

    from shmkv.services.maintainer import MaintainerRole

    store, pid, _lease, _r = stopped_holder
    caplog.set_level(logging.INFO, logger="shmkv")
    cfg = load_config({"cache_name": store.name, "lock_timeout": BOUND}, env={})
    role = MaintainerRole(cfg, TierChain(store), interval_s=0.01, yield_to_daemon=False)
    role.start()
    try:
        deadline = time.monotonic() + 30
        while store.stats()["lock_timeouts"] < 20 and time.monotonic() < deadline:  # many passes against it
            role._stop.wait(0.05)
    finally:
        role.stop()
    paused = [r for r in caplog.records if "maintenance paused" in r.getMessage()]
    assert len(paused) == 1 and f"pid {pid}" in paused[0].getMessage(), [r.getMessage() for r in caplog.records]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
