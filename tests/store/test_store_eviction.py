"""LRU eviction under the byte cap; FULL when nothing can be evicted."""

from __future__ import annotations

import pytest
from helpers import key, payload_for

from shmkv import PutResult, Store

UNIT = 4096


@pytest.fixture
def store(cache_name):
    s = Store.create(cache_name, 2 << 20, alignment=UNIT, max_entries=1024)
    yield s
    s.close()


def units(store) -> int:
    return store.arena_bytes // UNIT


def test_byte_cap_is_never_exceeded(store):
    cap = store.arena_bytes
    for i in range(3 * units(store)):
        assert store.put(key(i), payload_for(key(i), 1 + (i * 7919) % (3 * UNIT))) is PutResult.OK
        assert store.stats()["bytes_used"] <= cap
    st = store.stats()
    assert st["evictions"] > 0
    assert store.check_consistency() == []


def test_least_recently_used_goes_first(store):
    n = units(store)
    for i in range(n):
        store.put(key(i), b"x" * UNIT)
    assert store.get(key(0)) is not None  # key 0 becomes most recent
    store.put(key("new"), b"y" * UNIT)  # evicts exactly one: key 1
    assert store.contains([key(0), key(1), key(2)]) == [True, False, True]
    assert store.stats()["evictions"] == 1


def test_a_put_of_a_chunk_held_makes_it_the_newest(store):
    """An engine whose own prefix cache served a prefix puts its chunks again
    (EXISTS): shmkv's copy is in use, so it must not age out first."""
    n = units(store)
    for i in range(n):
        store.put(key(i), b"x" * UNIT)
    assert store.put(key(0), b"x" * UNIT) is PutResult.EXISTS
    store.put(key("new"), b"y" * UNIT)  # evicts exactly one: key 1, not key 0
    assert store.contains([key(0), key(1), key(2)]) == [True, False, True]
    assert store.check_consistency() == []


def test_leased_and_pinned_entries_are_not_evicted(store):
    n = units(store)
    for i in range(n):
        store.put(key(i), payload_for(key(i), UNIT))
    lease = store.acquire(key(0))
    assert store.pin(key(1))
    for i in range(n, 2 * n):
        store.put(key(i), b"z" * UNIT)
    assert store.contains([key(0), key(1)]) == [True, True]
    assert bytes(lease.view()) == payload_for(key(0), UNIT)
    lease.release()
    assert store.check_consistency() == []


def test_full_when_everything_is_leased_or_pinned(store):
    n = units(store)
    for i in range(n):
        store.put(key(i), payload_for(key(i), UNIT))
    leases = [store.acquire(key(i)) for i in range(n // 2)]
    for i in range(n // 2, n):
        store.pin(key(i))
    assert store.put(key("more"), b"m" * UNIT) is PutResult.FULL
    assert store.reserve(key("more"), UNIT) is PutResult.FULL
    st = store.stats()
    assert st["put_full"] == 2 and st["evictions"] == 0
    # earlier entries stay readable
    for i in range(n):
        assert store.get(key(i)) == payload_for(key(i), UNIT)
    for lease in leases:
        lease.release()
    assert store.put(key("more"), b"m" * UNIT) is PutResult.OK


def test_full_does_not_destroy_the_cache_for_an_impossible_put(store):
    n = units(store)
    for i in range(n):
        store.put(key(i), b"x" * UNIT)
    for i in range(n - 2):
        store.pin(key(i))
    # 3 units cannot be made from 2 evictable ones: nothing is evicted
    assert store.put(key("big"), b"b" * 3 * UNIT) is PutResult.FULL
    assert store.stats()["evictions"] == 0
    assert store.contains([key(n - 2), key(n - 1)]) == [True, True]


def test_entry_table_full_evicts_for_a_record(cache_name):
    with Store.create(cache_name, 2 << 20, alignment=64, max_entries=8) as s:
        for i in range(20):
            assert s.put(key(i), b"r" * 64) is PutResult.OK
        st = s.stats()
        assert st["entries"] == 8 and st["entry_table_full"] > 0
        assert s.check_consistency() == []


def test_removal_count_moves_with_every_removal(store):
    """The cheap counter the native tier polls each step: evictions, deletes and clears move it,
    puts and gets do not."""
    n = units(store)
    for i in range(n):
        store.put(key(i), b"x" * UNIT)
    before = store.removal_count()
    assert store.get(key(0)) is not None and store.removal_count() == before
    store.put(key("new"), b"y" * UNIT)  # evicts one
    assert store.removal_count() == before + 1
    assert store.delete(key(2))
    assert store.removal_count() == before + 2
    removed = store.clear()
    assert store.removal_count() == before + 2 + removed
    st = store.stats()
    assert store.removal_count() == st["evictions"] + st["deletes"] + st["epoch"]
