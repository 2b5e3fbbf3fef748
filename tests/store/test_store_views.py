"""Views never outlive what they view: a lease's views are read-only (its
torch tensor a copy); a reservation will not commit while a numpy/torch
object made from it lives, and an abort keeps its room out of reuse until
that object is gone."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from helpers import key

from shmkv import PutResult, Store
from shmkv.errors import StaleHandleError
from shmkv.store import Reservation


@pytest.fixture
def store(cache_name):
    s = Store.create(cache_name, 4 << 20, alignment=4096, max_entries=1024, populate=False)
    yield s
    s.close()


def test_a_leases_views_cannot_change_the_chunk(store):
    assert store.put(key(1), b"\x07" * 4096) is PutResult.OK
    with store.acquire(key(1)) as lease:
        assert lease.view().readonly
        a = lease.numpy()
        assert not a.flags.writeable
        with pytest.raises(ValueError):
            a[0] = 1
        t = lease.torch()
        t[0] = 1  # a copy: the chunk is untouched
        del a, t
    with store.acquire(key(1)) as lease:
        assert bytes(lease.view()) == b"\x07" * 4096


def test_commit_refuses_while_a_view_is_exported(store):
    r = store.reserve(key(2), 4096)
    a = r.numpy()
    a[:] = 3
    with pytest.raises(StaleHandleError, match=key(2).hex()):
        r.commit()
    assert r.is_open and not store.contains([key(2)])[0]
    del a
    assert r.commit() is PutResult.OK
    with store.acquire(key(2)) as lease:
        assert bytes(lease.view()) == b"\x03" * 4096


def test_an_aborted_reservations_room_is_not_reused_while_its_view_lives(store):
    n = store.arena_bytes // 4096
    r = store.reserve(key("held"), 4096)
    stale = r.torch()
    r.abort()  # deferred: `stale` still writes into that extent
    for i in range(2 * n):  # fill and churn the whole segment
        assert store.put(key(("fill", i)), np.full(4096, 5, np.uint8)) is PutResult.OK
    stale[:] = 9  # writes only into the held room
    for i in range(2 * n):
        lease = store.acquire(key(("fill", i)))
        if lease is not None:
            with lease:
                assert (lease.numpy() == 5).all(), f"chunk {i} took the aborted extent"
    del stale
    gc.collect()
    aborted = store.stats()["writes_aborted"]
    assert store.put(key("next"), b"\x01" * 4096) is PutResult.OK
    assert store.stats()["writes_aborted"] == aborted, "put alone does not abort it"
    after = store.reserve(key("after"), 4096)  # a reserve runs the deferred abort first
    assert isinstance(after, Reservation) and store.stats()["writes_aborted"] == aborted + 1
    after.abort()
    assert store.check_consistency() == []


def test_torch_view_of_a_reservation_is_zero_copy(store):
    r = store.reserve(key(3), 4096)
    t = r.torch(torch.uint8)
    t.fill_(4)
    del t
    assert r.commit() is PutResult.OK
    with store.acquire(key(3)) as lease:
        assert bytes(lease.view()) == b"\x04" * 4096
