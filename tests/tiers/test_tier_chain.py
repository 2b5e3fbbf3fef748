"""The tier chain, with in-memory tiers behind the Tier protocol: the prefix
walk continues from the shared tier into each lower tier in order and ends at
the first unit no tier holds; every TP rank's key must be in one tier; the
tail piece may come from any tier; promotion reads from the first tier that
has a chunk; clear reaches every tier."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import payload_for

from shmkv import Store
from shmkv.chunking import Chunker
from shmkv.tiers import TierChain

ROOTS = (b"r" * 16,)
CHUNK, PIECE = 256, 128


class DictTier:
    """A lower tier in a dict: {(key, namespace): payload}."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.chunks: dict[tuple[bytes, bytes], bytes] = {}
        self.asked = 0

    def contains(self, keys, namespaces):
        self.asked += 1
        return [(k, ns) in self.chunks for k, ns in zip(keys, namespaces)]

    def fetch(self, key, namespace):
        raw = self.chunks.get((key, namespace))
        return None if raw is None else (raw, namespace)

    def fetch_into(self, key, namespace, alloc, *, max_raw=None):
        raw = self.chunks.get((key, namespace))
        if raw is None or (max_raw is not None and len(raw) > max_raw):
            return None
        buf = alloc(len(raw), namespace)
        if buf is None:
            return None
        memoryview(buf).cast("B")[:] = raw
        return buf, namespace

    def write(self, key, namespace, raw, tokens=0):
        self.chunks[(key, namespace)] = bytes(raw)
        return True

    def remove(self, key, namespace):
        return self.chunks.pop((key, namespace), None) is not None

    def clear(self, namespace=None):
        gone = [k for k in self.chunks if namespace is None or k[1] == namespace]
        for k in gone:
            del self.chunks[k]
        return len(gone)


@pytest.fixture
def store(cache_name):
    with Store.create(cache_name, 8 << 20, alignment=64) as s:
        yield s


def prompt(n: int) -> np.ndarray:
    return np.random.default_rng(5).integers(0, 30000, n)


def test_the_walk_goes_shm_then_each_lower_tier_and_stops_at_the_first_gap(store):
    disk, remote = DictTier("disk"), DictTier("remote")
    chain = TierChain(store, [disk, remote])
    ch = Chunker(ROOTS, CHUNK, PIECE)
    t = prompt(2000)  # 7 chunks and a 128-token piece
    units = ch.units(t)
    store.put(units[0].keys[0], b"m" * 64, namespace=ROOTS[0])
    disk.write(units[1].keys[0], ROOTS[0], b"d")
    remote.write(units[1].keys[0], ROOTS[0], b"r")  # also below: the first tier in order wins
    remote.write(units[2].keys[0], ROOTS[0], b"r")
    disk.write(units[4].keys[0], ROOTS[0], b"d")  # after a gap: useless
    found = ch.cached_prefix(chain, t, units, lower=True)
    assert [(u.start, tier) for u, tier in found] == [(0, "shm"), (256, "disk"), (512, "remote")]
    assert [tier for _, tier in ch.cached_prefix(chain, t, units, lower=False)] == ["shm"]


def test_the_tail_piece_may_come_from_a_lower_tier(store):
    disk = DictTier("disk")
    chain = TierChain(store, [disk])
    ch = Chunker(ROOTS, CHUNK, PIECE)
    t = prompt(400)  # one chunk and a 128-token piece
    chunk, piece = ch.units(t)
    store.put(chunk.keys[0], b"m" * 64, namespace=ROOTS[0])
    disk.write(piece.keys[0], ROOTS[0], b"d")
    found = ch.cached_prefix(chain, t, [chunk, piece])
    assert [(u.end, tier) for u, tier in found] == [(256, "shm"), (384, "disk")]


def test_every_rank_must_be_held_by_one_tier(store):
    roots = (b"a" * 16, b"b" * 16)
    disk = DictTier("disk")
    chain = TierChain(store, [disk])
    ch = Chunker(roots, CHUNK)
    t = prompt(600)
    units = ch.units(t)
    store.put(units[0].keys[0], b"m" * 64, namespace=roots[0])
    disk.write(units[0].keys[1], roots[1], b"d")  # rank 1 of chunk 0 is on disk only
    assert ch.cached_prefix(chain, t, units) == []
    disk.write(units[0].keys[0], roots[0], b"d")
    assert [tier for _, tier in ch.cached_prefix(chain, t, units)] == ["disk"]


@pytest.mark.parametrize("threads", [1, 3])
def test_promotion_reads_from_the_first_tier_holding_each_chunk(store, threads):
    """Sequential, or fetched three at a time and put in prefix order."""
    disk, remote = DictTier("disk"), DictTier("remote")
    chain = TierChain(store, [disk, remote], threads=threads)
    keys = [bytes([i]) * 16 for i in range(4)]
    disk.write(keys[0], ROOTS[0], payload_for(keys[0], 256))
    remote.write(keys[0], ROOTS[0], b"stale copy")
    remote.write(keys[1], ROOTS[0], payload_for(keys[1], 256))
    remote.write(keys[3], ROOTS[0], payload_for(keys[3], 256))
    assert chain.promote(keys, [ROOTS[0]] * 4) == 2, "chunk 2 is nowhere: the prefix ends there"
    assert store.get(keys[0]) == payload_for(keys[0], 256) and store.get(keys[1]) == payload_for(keys[1], 256)
    assert not store.contains([keys[3]])[0]
    st = store.stats()
    assert st["disk_hits"] == 1 and st["remote_hits"] == 1 and st["promote_bytes"] == 512


def test_clear_reaches_every_tier(store):
    disk, remote = DictTier("disk"), DictTier("remote")
    chain = TierChain(store, [disk, None, remote])  # an absent tier is skipped
    other = b"o" * 16
    store.put(b"k" * 16, b"x" * 64, namespace=ROOTS[0])
    store.put(b"l" * 16, b"x" * 64, namespace=other)
    disk.write(b"k" * 16, ROOTS[0], b"d")
    remote.write(b"k" * 16, ROOTS[0], b"r")
    remote.write(b"l" * 16, other, b"r")
    assert chain.clear(ROOTS[0]) == {"shm": 1, "disk": 1, "remote": 1}
    assert store.contains([b"l" * 16]) == [True] and remote.chunks == {(b"l" * 16, other): b"r"}
