"""The maintainer: spill ahead of need, keep free space above the low
watermark by evicting spilled chunks, promote disk hits back exactly; the
role lock admits one maintainer per cache."""

from __future__ import annotations

import os

import pytest
from helpers import key, payload_for

from shmkv import PutResult, Store
from shmkv.paths import maintainer_lock
from shmkv.services.maintainer import Maintainer
from shmkv.store import FLAG_SPILLED
from shmkv.tiers import TierChain
from shmkv.tiers.disk.tier import DiskTier

UNIT = 64 * 1024


@pytest.fixture
def setup(cache_name, tmp_path):
    store = Store.create(cache_name, 4 << 20, alignment=UNIT, max_entries=256)
    disk = DiskTier(str(tmp_path / "disk"), capacity_bytes=1 << 30, counter=store.bump)
    disk.rebuild_index()
    yield store, disk, Maintainer(TierChain(store, [disk]), low_watermark=0.25, spill_ahead=0.25)
    store.close()


def tokens_of(i: int) -> int:
    return 100 + i  # a token count per chunk, all different


def fill(store, n, start=0):
    for i in range(start, start + n):
        assert store.put(key(i), payload_for(key(i), UNIT), namespace=b"N" * 16, tokens=tokens_of(i)) is PutResult.OK


def test_spill_ahead_writes_the_coldest_without_reordering(setup):
    store, disk, m = setup
    units = store.arena_bytes // UNIT
    fill(store, units // 2)
    cold_before = [k for k, *_ in store.coldest(units)]
    did = m.run_once()
    assert did["spilled"] == (units * 25 // 100 * UNIT + UNIT - 1) // UNIT or did["spilled"] > 0
    assert did["evicted"] == 0, "plenty of free space: nothing evicted"
    assert [k for k, *_ in store.coldest(units)] == cold_before, "spill reads are not uses"
    spilled = [k for k, _, flags, _, _ in store.coldest(units) if flags & FLAG_SPILLED]
    assert spilled == cold_before[: len(spilled)], "the coldest are spilled first"
    for k in spilled:
        assert disk.read(k) is not None
    st = store.stats()
    assert st["spills"] == len(spilled) and st["spill_bytes"] == len(spilled) * UNIT
    assert st["put_tokens"] == sum(tokens_of(i) for i in range(units // 2))
    by_key = {key(i): tokens_of(i) for i in range(units // 2)}
    assert st["spill_tokens"] == sum(by_key[k] for k in spilled), "each spill counts its own chunk's tokens"


def test_low_watermark_evicts_only_spilled_chunks(setup):
    store, disk, m = setup
    units = store.arena_bytes // UNIT
    fill(store, units)
    m.run_once()
    st = store.stats()
    free = st["arena_bytes"] - st["bytes_used"]
    assert free >= m.low_bytes
    assert st["evicted_unspilled"] == 0
    # evicted chunks are on disk, byte for byte
    gone = [i for i in range(units) if not store.contains([key(i)])[0]]
    assert gone
    for i in gone:
        assert disk.read(key(i)) == payload_for(key(i), UNIT)


def test_puts_that_outrun_the_maintainer_count_unspilled_evictions(setup):
    store, _, _ = setup
    units = store.arena_bytes // UNIT
    fill(store, units + 3)
    assert store.stats()["evicted_unspilled"] == 3


@pytest.mark.parametrize("threads", [1, 3])
def test_promote_brings_back_exact_bytes_in_prefix_order(setup, threads):
    store, disk, m = setup
    units = store.arena_bytes // UNIT
    fill(store, 6)
    m.spill_all()
    store.clear()
    keys = [key(i) for i in range(6)]
    os.unlink(disk.path(keys[4]))
    before = store.stats()["put_tokens"]
    chain = TierChain(store, [disk], threads=threads)
    assert chain.promote(keys, [b"N" * 16] * 6, tokens=[tokens_of(i) for i in range(6)]) == 4, \
        "stops at the first chunk not on disk"
    chain.close()
    assert store.contains(keys) == [True] * 4 + [False] * 2, "nothing past the gap, even fetched ahead"
    assert not [e for e in store.entries() if e["state"] != "ready"], "reservations ahead of the gap are aborted"
    assert store.check_consistency() == []
    assert store.stats()["put_tokens"] - before == sum(tokens_of(i) for i in range(4))
    for i in range(4):
        assert store.get(key(i)) == payload_for(key(i), UNIT)
    st = store.stats()
    assert st["disk_hits"] == 4 and st["promote_bytes"] == 4 * UNIT
    assert all(flags & FLAG_SPILLED for _, _, flags, _, _ in store.coldest(units)), "promoted chunks are known spilled"


def test_pinned_chunks_are_neither_spilled_nor_evicted(setup):
    store, disk, m = setup
    units = store.arena_bytes // UNIT
    fill(store, units)
    for i in range(units):
        store.pin(key(i))
    m.run_once()
    assert store.stats()["spills"] == 0 and store.stats()["evictions"] == 0


def test_one_maintainer_per_cache(cache_name, child):
    lock = maintainer_lock(cache_name)
    assert lock.try_acquire()
    c = child(f"""
        from shmkv.paths import maintainer_lock
        print("got" if maintainer_lock({cache_name!r}).try_acquire() else "refused", flush=True)
    """)
    assert c.expect("refused")
    c.finish()
    assert lock.holder_pid() == os.getpid()
    lock.release()
    c2 = child(f"""
        from shmkv.paths import maintainer_lock
        print("got" if maintainer_lock({cache_name!r}).try_acquire() else "refused", flush=True)
    """)
    assert c2.expect("got")
    c2.finish()


def test_parallel_spill_writes_every_chunk_once(cache_name, tmp_path):
    store = Store.create(cache_name, 4 << 20, alignment=4096)
    disk = DiskTier(str(tmp_path / "disk"), capacity_bytes=1 << 30, counter=store.bump)
    m = Maintainer(TierChain(store, [disk]), threads=3)
    fill(store, 10)
    assert m.spill_all() == (10, 0)
    assert store.stats()["spills"] == 10 and sum(n.endswith(".kv") for n in os.listdir(disk.dir)) == 10
    for i in range(10):
        assert disk.read(key(i)) == payload_for(key(i), UNIT)
    m.close()
    store.close()
