"""Compressed entries of the shared tier (what POST /compress makes): a chunk
re-encoded in place loads back byte for byte, is counted in the
compressed_* gauges, spills to disk as it is and decodes there, is put back
raw by decompress, and a damaged one is recomputed, never loaded."""

from __future__ import annotations

import ctypes

import pytest
import torch
from kv_reference import make_cache

from shmkv import Store
from shmkv.integration.vllm.planner import GroupWindow, LoadItem, StoreItem
from shmkv.services.maintainer import Maintainer
from shmkv.tiers import TierChain, recode
from shmkv.tiers.disk.tier import DiskTier
from shmkv.transfer import TransferEngine as KVWorker
from shmkv.transfer.layout import KVLayout

BS = 16
NS = b"N" * 16
KEYS = [bytes([i]) * 16 for i in range(1, 5)]


def gaussian_cache(seed: int) -> list[torch.Tensor]:
    """A paged cache of bf16 Gaussian values (KV-like: compressible ~1.4x)."""
    cache = make_cache("nhd", 2, 16, BS, 2, 64, torch.bfloat16, seed=seed)
    g = torch.Generator().manual_seed(seed)
    for t in cache:
        t.copy_(torch.randn(t.shape, generator=g).to(torch.bfloat16))
    return cache


@pytest.fixture
def setup(cache_name):
    store = Store.create(cache_name, 16 << 20, alignment=256)
    src, dst = gaussian_cache(1), gaussian_cache(2)
    a, b = KVWorker(store, KVLayout("cpu", src), 0), KVWorker(store, KVLayout("cpu", dst), 0)
    a.store([StoreItem("r", (k,), 2 * BS, (GroupWindow(0, 2, (2 * i, 2 * i + 1)),), namespaces=(NS,))
             for i, k in enumerate(KEYS)])
    assert a.counters["stored_units"] == len(KEYS)
    yield store, b, src, dst
    store.close()


def load_all(b: KVWorker) -> set[int]:
    failed, _ = b.load([LoadItem("q", (k,), (GroupWindow(0, 2, (2 * i + 8, 2 * i + 9)),))
                        for i, k in enumerate(KEYS)])
    return failed


def same_blocks(src, dst) -> bool:
    return all(torch.equal(s[2 * i + j].view(torch.uint8), d[2 * i + 8 + j].view(torch.uint8))
               for s, d in zip(src, dst) for i in range(len(KEYS)) for j in range(2))


def recode_all(store: Store, how: str) -> list[str]:
    entries = [e for e in store.entries() if e["state"] == "ready"]
    return [recode.compress(store, e, element_size=2) if how == "compress" else recode.decompress(store, e)
            for e in entries]


def test_compress_load_decompress_load(setup):
    store, b, src, dst = setup
    raw_bytes = store.stats()["bytes_used"]
    assert recode_all(store, "compress") == ["compressed"] * len(KEYS)
    st = store.stats()
    assert st["compressed_entries"] == len(KEYS)
    assert st["compressed_bytes"] * 1.2 < raw_bytes, "bf16 Gaussian KV shrinks"
    assert st["put_tokens"] == 2 * len(KEYS) * 2 * BS, "the token counts move with the chunks"
    assert recode_all(store, "compress") == ["already"] * len(KEYS)
    assert store.check_consistency() == []

    assert load_all(b) == set()
    assert same_blocks(src, dst), "a load of a compressed chunk is exact"
    assert b.counters["load_decoded"] == len(KEYS)
    assert store.stats()["leases_held"] == 0

    for t in dst:
        t.zero_()
    assert recode_all(store, "decompress") == ["decompressed"] * len(KEYS)
    st = store.stats()
    assert (st["compressed_entries"], st["compressed_bytes"]) == (0, 0)
    assert load_all(b) == set() and same_blocks(src, dst)
    assert store.check_consistency() == []


def test_pinned_and_incompressible_chunks_are_left_alone(setup):
    store, _, _, _ = setup
    store.pin(KEYS[0])
    store.put(b"R" * 16, bytes(range(256)) * 64, namespace=NS)  # a repeating pattern: compresses
    outcome = dict(zip([e["key"] for e in store.entries() if e["state"] == "ready"], recode_all(store, "compress")))
    assert outcome[KEYS[0]] == "pinned"
    assert all(outcome[k] == "compressed" for k in KEYS[1:])
    random_chunk = torch.randint(0, 256, (65536,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    store.put(b"X" * 16, random_chunk.numpy(), namespace=NS)
    entry = next(e for e in store.entries() if e["key"] == b"X" * 16)
    assert recode.compress(store, entry, element_size=2) == "incompressible"
    assert outcome[b"R" * 16] == "compressed"
    assert store.stats()["compressed_entries"] == len(KEYS)


def test_a_compressed_chunk_spills_as_it_is_and_promotes_raw(setup, tmp_path):
    store, b, src, dst = setup
    before = {k: store.get(k) for k in KEYS}
    recode_all(store, "compress")
    disk = DiskTier(str(tmp_path / "disk"), capacity_bytes=1 << 30, counter=store.bump)
    m = Maintainer(TierChain(store, [disk]))
    assert m.spill_all() == (len(KEYS), 0)
    assert all(disk.read(k) == before[k] for k in KEYS), "the file decodes to the raw payload"
    st = store.stats()
    assert st["spill_bytes"] == sum(map(len, before.values())) and st["spill_tokens"] == len(KEYS) * 2 * BS
    store.clear()
    assert TierChain(store, [disk]).promote(KEYS, [NS] * len(KEYS)) == len(KEYS)
    assert store.stats()["compressed_entries"] == 0, "promotion puts the raw payload"
    assert load_all(b) == set() and same_blocks(src, dst)


def test_a_damaged_compressed_chunk_is_recomputed(setup):
    store, b, _, _ = setup
    recode_all(store, "compress")
    lease = store.acquire(KEYS[1])
    with lease:  # damage in place, as a stray write into the segment would
        byte = ctypes.c_uint8.from_address(lease.address + lease.size // 2)
        byte.value ^= 0x55
    failed = load_all(b)
    assert {10, 11} <= failed, "the damaged chunk's blocks are recomputed"
    assert b.counters["load_damaged"] == 1
    assert recode.decompress(store, next(e for e in store.entries() if e["key"] == KEYS[1])) == "damaged"
