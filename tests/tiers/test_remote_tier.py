"""The remote tier against a real redis-server: asynchronous writes (from the
disk file or the shared tier), checked reads, namespaces in keys, TTL, byte
budget, clear, and faults (server down, unresponsive, back again, garbage)."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import pytest
from helpers import key, payload_for

from shmkv import PutResult
from shmkv.services.maintainer import Maintainer
from shmkv.tiers import TierChain
from shmkv.tiers import format as fmt
from shmkv.tiers.disk.tier import DiskTier
from shmkv.tiers.remote.tier import RemoteTier, chunk_key

NS, NS2 = b"N" * 16, b"M" * 16
SIZE = 64 * 1024


@pytest.fixture
def store(small_store):
    return small_store


def tier(url, store=None, disk=None, **kw):
    r = RemoteTier(url, counter=store.bump if store is not None else None, **kw)
    if store is not None:
        TierChain(store, [disk, r])  # the chain gives the remote tier its bytes (its source)
    return r


def put(store, i, ns=NS):
    assert store.put(key(i), payload_for(key(i), SIZE), namespace=ns) is PutResult.OK


def test_write_from_the_shared_tier_then_read_back(store, redis_server):
    r = tier(redis_server.url, store)
    for i in range(3):
        put(store, i)
        assert r.enqueue(key(i), NS, tokens=256)
    assert r.flush(timeout_s=30)
    st = store.stats()
    assert st["remote_puts"] == 3 and st["remote_put_bytes"] > 0 and st["remote_put_errors"] == 0
    assert st["remote_put_tokens"] == 3 * 256
    assert redis_server.client().exists(chunk_key(key(0), NS)), "the namespace is part of the key"
    assert r.contains([key(0), key(1), key(2), key(3)], [NS] * 4) == [True, True, True, False]
    assert r.contains([key(0)], [NS2]) == [False], "another namespace does not see it"
    for i in range(3):
        assert r.fetch(key(i), NS) == (payload_for(key(i), SIZE), NS)
    assert r.fetch(key(0), NS2) is None
    assert store.stats()["remote_misses"] == 3  # key 3, key 0 under NS2 twice
    r.close()


def test_spilled_chunks_go_as_their_disk_file(store, redis_server, tmp_path):
    disk = DiskTier(str(tmp_path / "disk"), capacity_bytes=1 << 30, counter=store.bump)
    disk.rebuild_index()
    r = tier(redis_server.url, store, disk)
    m = Maintainer(TierChain(store, [disk, r]), spill_ahead=0.0, low_watermark=0.0)
    for i in range(4):
        put(store, i)
    assert m.spill_all() == (4, 0)
    assert r.flush(timeout_s=30)
    client = redis_server.client()
    for i in range(4):
        with open(disk.path(key(i)), "rb") as f:
            assert client.get(chunk_key(key(i), NS)) == f.read(), "no second compression: the file's bytes"
    r.close()


def test_promote_from_remote_in_prefix_order(store, redis_server, cache_name):
    r = tier(redis_server.url, store)
    for i in range(3):
        r.put_encoded(key(i), NS, fmt.encode(key(i), NS, payload_for(key(i), SIZE)))
    keys = [key(i) for i in range(5)]
    n = TierChain(store, [r]).promote(keys, [NS] * 5)
    assert n == 3, "chunks 0-2 from the remote; 3 is a miss and ends the prefix"
    for i in range(3):
        assert store.get(key(i)) == payload_for(key(i), SIZE)
    st = store.stats()
    assert st["remote_hits"] == 3 and st["promote_bytes"] == 3 * SIZE
    r.close()


GARBAGE = {
    "random bytes": lambda k, ns: os.urandom(500),
    "empty": lambda k, ns: b"",
    "truncated": lambda k, ns: fmt.encode(k, ns, payload_for(k, SIZE))[:-10],
    "another key's chunk": lambda k, ns: fmt.encode(key("other"), ns, payload_for(k, SIZE)),
    "another namespace's chunk": lambda k, ns: fmt.encode(k, NS2, payload_for(k, SIZE)),
    "flipped payload bit": lambda k, ns: _flip(fmt.encode(k, ns, payload_for(k, SIZE)), -3),
}


def _flip(b: bytes, i: int) -> bytes:
    a = bytearray(b)
    a[i] ^= 0x40
    return bytes(a)


@pytest.mark.parametrize("kind", sorted(GARBAGE))
def test_garbage_values_are_rejected_by_the_checks(store, redis_server, kind):
    r = tier(redis_server.url, store)
    client = redis_server.client()
    client.set(chunk_key(key(1), NS), GARBAGE[kind](key(1), NS))
    assert r.fetch(key(1), NS) is None
    assert store.stats()["remote_damaged"] == 1
    assert not client.exists(chunk_key(key(1), NS)), "a damaged value is removed"
    assert TierChain(store, [r]).promote([key(1)], [NS]) == 0
    assert not store.contains([key(1)])[0]
    r.close()


def test_ttl_and_byte_budget(store, redis_server):
    client = redis_server.client()
    r = tier(redis_server.url, store, ttl_s=300)
    r.put_encoded(key(1), NS, fmt.encode(key(1), NS, payload_for(key(1), SIZE)))
    assert 0 < client.ttl(chunk_key(key(1), NS)) <= 300
    r.close()
    one = len(fmt.encode(key(0), NS, payload_for(key(0), SIZE)))
    r = tier(redis_server.url, store, capacity_bytes=3 * one + one // 2)
    for i in range(10, 16):
        r.put_encoded(key(i), NS, fmt.encode(key(i), NS, payload_for(key(i), SIZE)))
    present = [i for i in range(10, 16) if client.exists(chunk_key(key(i), NS))]
    assert present == [13, 14, 15], "the oldest writes are dropped to stay within the budget"
    assert int(client.get(b"shmkv:v1:m:bytes")) <= 3 * one + one // 2
    r.close()


def test_clear_one_namespace_or_all(store, redis_server):
    r = tier(redis_server.url, store, capacity_bytes=1 << 30)
    for i in range(3):
        r.put_encoded(key(i), NS, fmt.encode(key(i), NS, b"a" * 1000))
        r.put_encoded(key(i), NS2, fmt.encode(key(i), NS2, b"b" * 1000))
    assert r.clear(NS) == 3
    assert r.contains([key(i) for i in range(3)], [NS2] * 3) == [True] * 3
    assert r.contains([key(0)], [NS]) == [False]
    assert r.clear() == 3
    assert int(redis_server.client().get(b"shmkv:v1:m:bytes")) == 0, "budget bookkeeping follows"
    r.close()


def test_server_killed_then_back(store, redis_server, caplog):
    r = tier(redis_server.url, store, timeout_s=0.5)
    put(store, 1)
    r.enqueue(key(1), NS)
    assert r.flush(timeout_s=30)
    redis_server.kill()
    with caplog.at_level(logging.WARNING, logger="shmkv.remote"):
        assert r.contains([key(1)], [NS]) == [False]
    assert "treated as a miss" in caplog.text
    st = store.stats()
    assert st["remote_errors"] == 1 and st["remote_misses"] == 1
    # while it is down, calls answer at once and count misses, not new errors
    assert r.fetch(key(1), NS) is None
    put(store, 2)
    r.enqueue(key(2), NS)
    assert r.flush(timeout_s=30)
    st = store.stats()
    assert st["remote_errors"] == 1 and st["remote_misses"] == 2 and st["remote_put_errors"] == 1
    redis_server.start()  # same port, empty
    deadline = time.monotonic() + 60
    while not r.available:  # the backoff expires on its own
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with caplog.at_level(logging.INFO, logger="shmkv.remote"):
        assert r.put_encoded(key(3), NS, fmt.encode(key(3), NS, b"c" * 100))
    assert "reachable again" in caplog.text
    assert r.contains([key(3)], [NS]) == [True]
    r.close()


def test_unresponsive_server_is_bounded_by_the_timeout(store):
    """A server that accepts connections but never answers: the call gives up
    after its timeout, and later calls skip it until the backoff expires."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        r = tier(f"redis://127.0.0.1:{listener.getsockname()[1]}/0", store, timeout_s=0.2)
        assert r.contains([key(1)], [NS]) == [False]  # cut at its deadline (test_remote_odd_servers counts how)
        assert r.fetch(key(1), NS) is None
        assert store.stats()["remote_errors"] == 1, "the second call did not wait again: answered by the backoff"
        r.close()
    finally:
        stop.set()
        t.join()
        listener.close()
        for s in accepted:
            s.close()


def test_full_queue_drops_and_counts(store, redis_server):
    r = tier(redis_server.url, store, max_queue=2)
    gate = threading.Event()
    real = r._encoded
    r._encoded = lambda k, ns: (gate.wait(30), real(k, ns))[1]  # hold the writer on its first item
    for i in range(5):
        put(store, i)
    results = [r.enqueue(key(i), NS) for i in range(5)]
    gate.set()
    assert r.flush(timeout_s=30)
    assert results.count(False) >= 2 and store.stats()["remote_dropped"] == results.count(False)
    assert store.stats()["remote_puts"] == results.count(True)
    r.close()
