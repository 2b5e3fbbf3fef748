"""Store benchmark: put/get GB/s against numpy memcpy of the same bytes, the
time of a batched longest-prefix lookup of 128 keys, and of a FULL answer.

put = reserve + copy in + commit; get = acquire + copy out + release.
Both memcpy baselines are reported (shmkv.bench.baselines); `memcpy_gbps`
and the ratios are the cold one: rotating destinations, as many slots as the
store rotates through.
"""

from __future__ import annotations

import argparse
import os
import time
import uuid

import numpy as np
import xxhash

from shmkv import PutResult, Store
from shmkv.bench import drop_cache
from shmkv.bench.baselines import median_gbps, memcpy_baselines

MiB = 1 << 20


def _key(tag: str, i: int) -> bytes:
    return xxhash.xxh3_128_digest(f"{tag}-{i}".encode())


def bench_size(chunk: int, slots: int, repeats: int) -> dict[str, float]:
    name = f"shmkv-bench-{uuid.uuid4().hex[:8]}"
    src = np.random.default_rng(0).integers(0, 255, chunk, dtype=np.uint8)
    dst = np.empty_like(src)
    dst[:] = src  # fault the pages in
    base = memcpy_baselines(chunk, slots, repeats * 4)
    memcpy = base["memcpy_cold_gbps"]
    store = Store.create(name, slots * chunk + 64 * MiB, max_payload_bytes=chunk)
    try:
        counter = iter(range(1 << 30))

        def put() -> None:
            assert store.put(_key("p", next(counter)), src) is PutResult.OK

        for _ in range(slots + 2):  # fill once, so later puts also evict
            put()
        put_gbps = median_gbps(put, chunk, repeats * 2)
        live = [_key("p", i) for i in range(next(counter) - slots // 2, next(counter) - 1)]
        it = iter(range(1 << 30))

        def get() -> None:
            k = live[next(it) % len(live)]
            assert store.get_into(k, dst) == chunk

        get_gbps = median_gbps(get, chunk, repeats * 2)
        assert bytes(dst[:64]) == bytes(src[:64])
        return {**base, "memcpy_gbps": memcpy, "put_gbps": put_gbps, "get_gbps": get_gbps,
                "put_ratio": put_gbps / memcpy, "get_ratio": get_gbps / memcpy}
    finally:
        store.close()
        drop_cache(name)


def bench_lookup(repeats: int) -> dict[str, float]:
    name = f"shmkv-bench-{uuid.uuid4().hex[:8]}"
    store = Store.create(name, 64 * MiB, alignment=256, max_entries=8192)
    try:
        keys = [_key("l", i) for i in range(128)]
        for k in keys:
            store.put(k, b"v" * 256)
        packed = b"".join(keys)
        for _ in range(100):
            store.lookup_prefix(keys)
        t0 = time.perf_counter()
        for _ in range(repeats):
            n = store.lookup_prefix(keys)
        list_us = (time.perf_counter() - t0) / repeats * 1e6
        assert n == 128
        t0 = time.perf_counter()
        for _ in range(repeats):
            store.lookup_prefix(packed)
        packed_us = (time.perf_counter() - t0) / repeats * 1e6
        # FULL: everything leased, a put must give up at once
        leases = store.acquire_prefix(keys)
        filler = 0
        while store.put(_key("f", filler), b"f" * 4096) is PutResult.OK:
            assert store.pin(_key("f", filler))  # pinned: cannot be evicted
            filler += 1
        t0 = time.perf_counter()
        for i in range(200):
            assert store.put(_key("x", i), b"x" * 4096) is PutResult.FULL
        full_us = (time.perf_counter() - t0) / 200 * 1e6
        for lease in leases:
            lease.release()
        return {"lookup_128_us": list_us, "lookup_128_packed_us": packed_us, "full_us": full_us}
    finally:
        store.close()
        drop_cache(name)


def run(argv: list[str]) -> dict:
    p = argparse.ArgumentParser(prog="shmkv bench store", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args(argv)
    big = bench_size(32 * MiB, 6, args.repeats)
    small = bench_size(2 * MiB, 32, args.repeats * 4)
    look = bench_lookup(5000)
    return {
        "chunk_bytes": 32 * MiB,
        "memcpy_gbps": big["memcpy_gbps"],
        "memcpy_warm_gbps": big["memcpy_warm_gbps"],
        "memcpy_cold_gbps": big["memcpy_cold_gbps"],
        "put_gbps": big["put_gbps"],
        "get_gbps": big["get_gbps"],
        "put_ratio": big["put_ratio"],
        "get_ratio": big["get_ratio"],
        "small_chunk_bytes": 2 * MiB,
        "small_memcpy_gbps": small["memcpy_gbps"],
        "small_memcpy_warm_gbps": small["memcpy_warm_gbps"],
        "small_put_gbps": small["put_gbps"],
        "small_get_gbps": small["get_gbps"],
        **look,
        "cpus": os.cpu_count(),
    }


def report(r: dict) -> None:
    print(f"memcpy baselines, 32 MiB: warm single buffer {r['memcpy_warm_gbps']:.1f} GB/s, rotating cold "
          f"slots {r['memcpy_cold_gbps']:.1f} GB/s (ratios below are against the cold one)")
    print(f"32 MiB chunks: memcpy {r['memcpy_gbps']:.1f} GB/s, put {r['put_gbps']:.1f} GB/s "
          f"({r['put_ratio']:.2f}x), get {r['get_gbps']:.1f} GB/s ({r['get_ratio']:.2f}x)")
    print(f" 2 MiB chunks: memcpy {r['small_memcpy_gbps']:.1f} GB/s, put {r['small_put_gbps']:.1f} "
          f"GB/s, get {r['small_get_gbps']:.1f} GB/s")
    print(f"lookup of 128 keys: {r['lookup_128_us']:.1f} us (list), "
          f"{r['lookup_128_packed_us']:.1f} us (packed); FULL answer: {r['full_us']:.1f} us")
