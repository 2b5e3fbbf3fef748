"""Four processes put and get thousands of chunks concurrently; every byte read
must match its key (payloads are derived from the key alone)."""

from __future__ import annotations

import multiprocessing as mp

import pytest
from helpers import key, payload_for

from shmkv import PutResult, Store

pytestmark = pytest.mark.slow

N_PROCS = 4
N_KEYS = 3000  # shared key space; the segment holds far fewer, so it evicts


def size_of(i: int) -> int:
    return 1024 + (i * 2654435761) % (60 * 1024)


def worker(name: str, seed: int, rounds: int, q: mp.Queue) -> None:
    import random

    rng = random.Random(seed)
    s = Store.attach(name)
    counts = {"puts": 0, "hits": 0, "checked_bytes": 0, "corrupt": 0, "full": 0}
    for _ in range(rounds):
        i = rng.randrange(N_KEYS)
        k = key(i)
        if rng.random() < 0.5:
            r = s.put(k, payload_for(k, size_of(i)))
            counts["puts"] += r is PutResult.OK
            counts["full"] += r is PutResult.FULL
        else:
            with_lease = rng.random() < 0.5
            if with_lease:
                lease = s.acquire(k)
                if lease is None:
                    continue
                with lease:
                    data = bytes(lease.view())
            else:
                data = s.get(k)
                if data is None:
                    continue
            counts["hits"] += 1
            counts["checked_bytes"] += len(data)
            counts["corrupt"] += data != payload_for(k, size_of(i))
    s.close()
    q.put(counts)


def test_four_processes_every_byte_checked(cache_name):
    store = Store.create(cache_name, 32 << 20, alignment=256)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(cache_name, seed, 4000, q)) for seed in range(N_PROCS)]
    for p in procs:
        p.start()
    results = [q.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    total = {k: sum(r[k] for r in results) for k in results[0]}
    assert total["corrupt"] == 0
    assert total["puts"] > 1000 and total["hits"] > 1000, total
    st = store.stats()
    assert st["evictions"] > 0, "the working set must exceed the segment"
    assert st["leases_held"] == 0
    assert store.check_consistency() == []
    store.close()
