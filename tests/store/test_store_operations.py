"""Each store operation and each ordinary outcome, in one process."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import key, payload_for

from shmkv import PutResult, Store
from shmkv.errors import InvalidArgumentError, PayloadTooLargeError
from shmkv.store import Lease, Reservation


@pytest.fixture
def store(cache_name):
    s = Store.create(cache_name, 4 << 20, alignment=64, max_entries=256, max_payload_bytes=1 << 20)
    yield s
    s.close()


def test_reserve_write_commit_then_get(store):
    k, data = key(1), payload_for(key(1), 5000)
    r = store.reserve(k, len(data))
    assert isinstance(r, Reservation)
    assert store.lookup_prefix([k]) == 0, "a WRITING entry must be invisible"
    r.view()[:] = data
    assert r.commit() is PutResult.OK
    assert store.get(k) == data
    assert store.stats()["puts"] == 1


def test_reservation_context_commits_or_aborts(store):
    with store.reserve(key(1), 10) as r:
        r.view()[:] = b"0123456789"
    assert store.get(key(1)) == b"0123456789"
    with pytest.raises(RuntimeError):
        with store.reserve(key(2), 10) as r:
            raise RuntimeError("writer failed")
    assert store.get(key(2)) is None
    st = store.stats()
    assert st["writes_aborted"] == 1 and st["entries"] == 1


def test_abort_frees_the_bytes(store):
    before = store.stats()["bytes_used"]
    r = store.reserve(key(1), 1000)
    assert store.stats()["bytes_used"] == before + 1024
    r.abort()
    assert store.stats()["bytes_used"] == before
    assert store.check_consistency() == []


def test_put_exists_and_busy(store):
    assert store.put(key(1), b"a" * 100) is PutResult.OK
    assert store.put(key(1), b"b" * 100) is PutResult.EXISTS
    r = store.reserve(key(2), 100)
    assert store.reserve(key(2), 100) is PutResult.BUSY, "a live writer owns the key"
    r.abort()
    st = store.stats()
    assert st["put_exists"] == 1 and st["put_busy"] == 1
    assert store.get(key(1)) == b"a" * 100


def test_miss_is_none(store):
    assert store.get(key(404)) is None
    assert store.acquire(key(404)) is None
    assert store.get_into(key(404), bytearray(10)) is None
    st = store.stats()
    assert st["misses"] == 3 and st["hits"] == 0


def test_get_into_copies_exact_bytes(store):
    data = payload_for(key(7), 3000)
    store.put(key(7), data)
    out = bytearray(4000)
    assert store.get_into(key(7), out) == 3000
    assert bytes(out[:3000]) == data
    with pytest.raises(ValueError, match="too small"):
        store.get_into(key(7), bytearray(10))


def test_lease_views_are_zero_copy_and_read_only(store):
    arr = np.arange(1000, dtype=np.float32)
    store.put(key(1), arr)
    with store.acquire(key(1)) as lease:
        assert isinstance(lease, Lease)
        a = lease.numpy(np.float32)
        np.testing.assert_array_equal(a, arr)
        assert not a.flags.writeable
        t = lease.torch(torch.float32, (10, 100))
        assert torch.equal(t, torch.from_numpy(arr).reshape(10, 100))
        assert lease.address == a.__array_interface__["data"][0]


def test_reservation_torch_view_writes_in_place(store):
    r = store.reserve(key(1), 256 * 2)
    t = r.torch(torch.bfloat16, (16, 16))
    t.copy_(torch.arange(256, dtype=torch.bfloat16).reshape(16, 16))
    del t
    assert r.commit() is PutResult.OK
    with store.acquire(key(1)) as lease:
        assert torch.equal(lease.torch(torch.bfloat16), torch.arange(256, dtype=torch.bfloat16))


def test_lookup_prefix_and_contains(store):
    keys = [key(i) for i in range(6)]
    for k in keys[:3]:
        store.put(k, b"x" * 64)
    store.put(keys[4], b"x" * 64)
    assert store.lookup_prefix(keys) == 3
    assert store.lookup_prefix(b"".join(keys)) == 3, "one contiguous buffer of keys works too"
    assert store.lookup_prefix(np.frombuffer(b"".join(keys), np.uint8).reshape(6, 16)) == 3
    assert store.lookup_prefix([]) == 0
    assert store.contains(keys) == [True, True, True, False, True, False]


def test_acquire_prefix_leases_the_hit_chunks(store):
    keys = [key(i) for i in range(5)]
    for k in keys[:4]:
        store.put(k, payload_for(k, 300))
    leases = store.acquire_prefix(keys)
    assert len(leases) == 4
    assert store.stats()["leases_held"] == 4
    for k, lease in zip(keys, leases):
        assert bytes(lease.view()) == payload_for(k, 300)
        assert lease.release()
    assert store.stats()["leases_held"] == 0


def test_pin_unpin_delete_clear(store):
    store.put(key(1), b"a" * 64)
    assert store.pin(key(1)) and store.pin(key(1))
    assert store.stats()["pinned_entries"] == 1
    assert store.unpin(key(1)) and store.unpin(key(1))
    assert not store.unpin(key(1)), "unpin of an unpinned key is a miss"
    assert not store.pin(key(99))
    assert store.delete(key(1)) and not store.delete(key(1))
    for i in range(5):
        store.put(key(i), b"z" * 64)
    assert store.clear() == 5
    assert store.stats()["entries"] == 0
    assert store.check_consistency() == []


def test_delete_while_leased_hides_now_frees_later(store):
    store.put(key(1), payload_for(key(1), 500))
    lease = store.acquire(key(1))
    assert store.delete(key(1))
    assert store.get(key(1)) is None
    assert store.stats()["bytes_used"] == 512, "bytes stay while the lease is held"
    assert bytes(lease.view()) == payload_for(key(1), 500)
    assert lease.release()
    assert store.stats()["bytes_used"] == 0
    assert store.check_consistency() == []


def test_errors_name_the_bad_input(store):
    with pytest.raises(PayloadTooLargeError, match="max_payload_bytes"):
        store.reserve(key(1), (1 << 20) + 1)
    with pytest.raises(InvalidArgumentError, match="> 0"):
        store.reserve(key(1), 0)
    with pytest.raises(ValueError, match="16 bytes"):
        store.get(b"short")
    with pytest.raises(TypeError, match="bytes"):
        store.get("a string key")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="16"):
        store.lookup_prefix(b"x" * 17)
    assert store.stats()["put_too_large"] == 1


def test_double_commit_and_double_release_are_rejected(store):
    r = store.reserve(key(1), 64)
    r.commit()
    with pytest.raises(ValueError, match="already"):
        r.commit()
    lease = store.acquire(key(1))
    lease.release()
    with pytest.raises(ValueError, match="already"):
        lease.release()


def test_dropped_handles_are_cleaned_up(store):
    r = store.reserve(key(1), 64)
    del r  # never committed: aborted by its destructor
    lease_holder = [store.put(key(2), b"q" * 64), store.acquire(key(2))]
    del lease_holder
    st = store.stats()
    assert st["leases_held"] == 0 and st["entries"] == 1 and st["writes_aborted"] == 1
    assert store.check_consistency() == []
