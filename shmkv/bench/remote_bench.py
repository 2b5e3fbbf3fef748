"""Remote tier throughput through Redis on loopback.

  put_gbps        raw bytes/s through the tier's write path (shuffle + zstd + SET)
  get_gbps        raw bytes/s through promotion (GET + checks + zstd + unshuffle + put into the segment)
  wire_put_gbps   encoded bytes/s of SET alone
  wire_get_gbps   encoded bytes/s of GET alone
  ratio           raw / encoded bytes

Chunks are Gaussian bf16 (KV-like). Without --url a private redis-server (or
valkey-server) is started on a free loopback port and stopped afterwards.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import redis
import torch
import xxhash

from shmkv import Store
from shmkv.bench.redis_server import PrivateRedis
from shmkv.config import load_config
from shmkv.tiers import format as fmt
from shmkv.tiers import open_tiers
from shmkv.tiers.remote.tier import chunk_key

MiB = 1 << 20
NS = b"bench-namespace!"


def run(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="python -m shmkv.bench remote")
    ap.add_argument("--url", help="an existing Redis/Valkey (default: start a private one)")
    ap.add_argument("--chunk-mib", type=float, default=8.0)
    ap.add_argument("--chunks", type=int, default=24)
    ap.add_argument("--level", type=int, default=1, help="zstd level")
    ap.add_argument("--repeats", type=int, default=3, help="best of N passes")
    a = ap.parse_args(argv)

    workdir = tempfile.mkdtemp(prefix="shmkv-bench-remote-")
    try:
        server = None if a.url else PrivateRedis(workdir)
    except FileNotFoundError as e:
        raise SystemExit(f"{e}; or pass --url") from e
    url = a.url or server.url  # type: ignore[union-attr]
    size = int(a.chunk_mib * MiB) // 2 * 2
    g = torch.Generator().manual_seed(0)
    chunks = [torch.randn(size // 2, generator=g).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
              for _ in range(a.chunks)]
    keys = [xxhash.xxh3_128_digest(f"bench-{i}".encode()) for i in range(a.chunks)]
    raw = sum(map(len, chunks))
    name = f"shmkv-bench-remote-{os.getpid()}"
    store = Store.create(name, a.chunks * size + 64 * MiB, max_payload_bytes=size, populate=False)
    chain = open_tiers(load_config({"cache_name": name, "remote_url": url, "remote_timeout": 30, "disk_level": a.level,
                                    "disk_shuffle_bytes": 2}, env={}), store)
    tier = chain.remote
    client = redis.Redis.from_url(url, socket_timeout=30)
    best: dict[str, float] = {}

    def keep(field: str, nbytes: int, seconds: float) -> None:
        best[field] = max(best.get(field, 0.0), nbytes / seconds / 1e9)

    try:
        encoded: list[bytes] = []
        for _ in range(a.repeats):
            tier.clear(NS)
            t0 = time.perf_counter()
            encoded = [fmt.encode(k, NS, c, element_size=2, level=a.level) for k, c in zip(keys, chunks)]
            for k, e in zip(keys, encoded):
                assert tier.put_encoded(k, NS, e), "remote write failed"
            keep("put_gbps", raw, time.perf_counter() - t0)

            store.clear()
            t0 = time.perf_counter()
            assert chain.promote(keys, [NS] * len(keys)) == len(keys)
            keep("get_gbps", raw, time.perf_counter() - t0)
            assert store.get(keys[-1]) == chunks[-1]

            wire = sum(map(len, encoded))
            t0 = time.perf_counter()
            for k, e in zip(keys, encoded):
                client.set(chunk_key(k, NS), e)
            keep("wire_put_gbps", wire, time.perf_counter() - t0)
            t0 = time.perf_counter()
            for k in keys:
                assert client.get(chunk_key(k, NS)) is not None
            keep("wire_get_gbps", wire, time.perf_counter() - t0)
        result = {f: round(v, 3) for f, v in best.items()}
        result.update({"ratio": round(raw / sum(map(len, encoded)), 3), "chunk_mib": a.chunk_mib,
                       "chunks": a.chunks, "level": a.level, "server": "private redis-server" if server else url})
        return result
    finally:
        tier.clear(NS)
        chain.close()
        client.close()
        store.close()
        Store.unlink(name)
        if server is not None:
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def report(r: dict) -> None:
    print(f"remote tier via {r['server']}: {r['chunks']} chunks of {r['chunk_mib']} MiB, zstd level {r['level']}, "
          f"ratio {r['ratio']}")
    print(f"  put  {r['put_gbps']:.3f} GB/s raw (encode + SET); SET alone {r['wire_put_gbps']:.3f} GB/s encoded")
    print(f"  get  {r['get_gbps']:.3f} GB/s raw (GET + decode + put); GET alone {r['wire_get_gbps']:.3f} GB/s encoded")
