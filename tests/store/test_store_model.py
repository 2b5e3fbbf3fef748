"""Hypothesis stateful test: the store against a plain dict + LRU model.

Every payload fits one allocation unit, so fragmentation cannot make the real
allocator and the model disagree: the model predicts exactly which keys are
cached, which put answers FULL, and which key each eviction removes.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict

from helpers import key, payload_for
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from shmkv import PutResult, Store

UNIT = 32 * 1024
KEYS = st.integers(min_value=0, max_value=40)


class StoreModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.name = f"shmkv-model-{uuid.uuid4().hex[:10]}"
        self.store = Store.create(self.name, 1 << 20, alignment=UNIT, max_entries=256)
        self.capacity = self.store.arena_bytes // UNIT  # units == entries that fit
        self.data: dict[int, bytes] = {}  # key -> payload of READY entries
        self.lru: OrderedDict[int, None] = OrderedDict()  # evictable keys, oldest first
        self.refs: dict[int, int] = {}
        self.pins: dict[int, int] = {}
        self.leases: list[tuple[int, bytes, object]] = []  # (key, expected bytes, lease)
        self.doomed: list[int] = []  # lease counts of deleted-while-leased entries
        self.version = 0

    def _occupied(self) -> int:
        return len(self.data) + sum(1 for n in self.doomed if n > 0)

    def _touch(self, k: int) -> None:
        self.lru.pop(k, None)
        if self.refs.get(k, 0) == 0 and self.pins.get(k, 0) == 0:
            self.lru[k] = None

    @rule(k=KEYS, size=st.integers(min_value=1, max_value=UNIT))
    def put(self, k: int, size: int) -> None:
        self.version += 1
        data = payload_for(key(f"{k}-{self.version}"), size)
        got = self.store.put(key(k), data)
        if k in self.data:
            assert got is PutResult.EXISTS
            self._touch(k)  # a put of a chunk held is a use
            return
        if self._occupied() >= self.capacity:
            if not self.lru:
                assert got is PutResult.FULL
                return
            victim = next(iter(self.lru))
            assert got is PutResult.OK
            assert not self.store.contains([key(victim)])[0], f"expected {victim} evicted"
            del self.lru[victim]
            del self.data[victim]
            self.pins.pop(victim, None)
        assert got is PutResult.OK
        self.data[k] = data
        self.refs[k] = 0
        self.lru[k] = None

    @rule(k=KEYS)
    def get(self, k: int) -> None:
        assert self.store.get(key(k)) == self.data.get(k)
        if k in self.data:
            self._touch(k)

    @rule(k=KEYS)
    def acquire(self, k: int) -> None:
        lease = self.store.acquire(key(k))
        assert (lease is None) == (k not in self.data)
        if lease is not None:
            self.refs[k] += 1
            self.lru.pop(k, None)
            self.leases.append((k, self.data[k], lease))

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(min_value=0))
    def release(self, i: int) -> None:
        k, expect, lease = self.leases.pop(i % len(self.leases))
        assert bytes(lease.view()) == expect
        assert lease.release()
        if k < 0:  # a deleted entry's lease
            self.doomed[-1 - k] -= 1
            return
        self.refs[k] -= 1
        self._touch(k)

    @rule(k=KEYS)
    def pin(self, k: int) -> None:
        assert self.store.pin(key(k)) == (k in self.data)
        if k in self.data:
            self.pins[k] = self.pins.get(k, 0) + 1
            self.lru.pop(k, None)

    @rule(k=KEYS)
    def unpin(self, k: int) -> None:
        ok = k in self.data and self.pins.get(k, 0) > 0
        assert self.store.unpin(key(k)) == ok
        if ok:
            self.pins[k] -= 1
            self._touch(k)

    @rule(k=KEYS)
    def delete(self, k: int) -> None:
        assert self.store.delete(key(k)) == (k in self.data)
        if k not in self.data:
            return
        del self.data[k]
        self.lru.pop(k, None)
        self.pins.pop(k, None)
        if self.refs[k] > 0:  # hidden now, its unit is freed at the last release
            self.doomed.append(self.refs[k])
            ghost = -len(self.doomed)
            self.leases = [((ghost if kk == k else kk), e, ll) for kk, e, ll in self.leases]
        self.refs[k] = 0

    @rule(k=KEYS)
    def lookup(self, k: int) -> None:
        expect = 0 if k not in self.data else (2 if (k + 1) in self.data else 1)
        assert self.store.lookup_prefix([key(k), key(k + 1)]) == expect

    @invariant()
    def consistent(self) -> None:
        st_ = self.store.stats()
        assert st_["bytes_used"] == self._occupied() * UNIT <= self.store.arena_bytes
        assert st_["ready_entries"] == len(self.data)
        assert st_["leases_held"] == len(self.leases)
        assert self.store.check_consistency() == []

    def teardown(self) -> None:
        for _, _, lease in self.leases:
            lease.release()
        self.store.close()
        Store.unlink(self.name)


StoreModel.TestCase.settings = settings(max_examples=80, stateful_step_count=80, deadline=None)
test_store_against_model = StoreModel.TestCase
