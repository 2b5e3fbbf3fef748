"""Remote tier throughput through Redis on loopback.

  put_gbps        raw bytes/s through the tier's write path (shuffle + zstd + SET)
  get_gbps        raw bytes/s through promotion (GET + checks + zstd + unshuffle + put into the segment)
  wire_put_gbps   encoded bytes/s of SET alone
  wire_get_gbps   encoded bytes/s of GET alone
  ratio           raw / encoded bytes

Chunks are Gaussian bf16 (KV-like). Without --url a private redis-server (or
valkey-server) is started on a free loopback port and stopped afterwards.

With --cluster the same run also starts a private Redis Cluster (3 primaries)
and measures both, each with --processes processes writing and promoting
their own chunks at once (each with its own segment, as hosts would):
{"single": {...}, "cluster": {...}} of aggregate put_gbps / get_gbps.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from typing import Any

import redis
import torch
import xxhash

from shmkv import Store
from shmkv.bench import drop_cache
from shmkv.config import load_config
from shmkv.engines.redis_server import PrivateRedis
from shmkv.tiers import format as fmt
from shmkv.tiers import open_tiers
from shmkv.tiers.remote.signing import chunk_key

MiB = 1 << 20
NS = b"bench-namespace!"


def run(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="shmkv bench remote", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="an existing Redis/Valkey (default: start a private one)")
    ap.add_argument("--chunk-mib", type=float, default=8.0)
    ap.add_argument("--chunks", type=int, default=24)
    ap.add_argument("--level", type=int, default=1, help="zstd level")
    ap.add_argument("--repeats", type=int, default=3, help="best of N passes")
    ap.add_argument("--processes", type=int, default=1, help="processes at once (aggregate GB/s)")
    ap.add_argument("--cluster", action="store_true",
                    help="measure a private single server and a private 3-primary cluster in one run")
    a = ap.parse_args(argv)
    if a.cluster or a.processes > 1:
        return _parallel(a)

    workdir = tempfile.mkdtemp(prefix="shmkv-bench-remote-")
    try:
        server = None if a.url else PrivateRedis(workdir)
    except FileNotFoundError as e:
        raise SystemExit(f"{e}; or pass --url") from e
    url = a.url or server.url  # type: ignore[union-attr]
    chunks, keys, name, store, chain = _setup(url, a, "")
    raw = sum(map(len, chunks))
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
        drop_cache(name)
        if server is not None:
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def _setup(url: str, a: argparse.Namespace, tag: str) -> tuple[list[bytes], list[bytes], str, Store, Any]:
    """(Gaussian bf16 chunks, their keys, segment name, segment, tier chain) of one benchmark process."""
    size = int(a.chunk_mib * MiB) // 2 * 2
    g = torch.Generator().manual_seed(len(tag))
    chunks = [torch.randn(size // 2, generator=g).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
              for _ in range(a.chunks)]
    keys = [xxhash.xxh3_128_digest(f"bench-{tag}{i}".encode()) for i in range(a.chunks)]
    name = f"shmkv-bench-remote-{os.getpid()}"
    store = Store.create(name, a.chunks * size + 64 * MiB, max_payload_bytes=size, populate=False)
    chain = open_tiers(load_config({"cache_name": name, "remote_url": url, "remote_timeout": 30, "disk_level": a.level,
                                    "disk_shuffle_bytes": 2}, env={}), store)
    return chunks, keys, name, store, chain


def _parallel(a: argparse.Namespace) -> dict:
    """Aggregate GB/s of a.processes processes at once, on a single server
    (a.url or a private one) and, with a.cluster, on a private cluster."""
    import multiprocessing

    from shmkv.engines.redis_server import PrivateRedisCluster

    workdir = tempfile.mkdtemp(prefix="shmkv-bench-remote-")
    servers: list = []
    try:
        for d in ("single", "cluster"):
            os.makedirs(os.path.join(workdir, d))
        targets = {"single": a.url or _started(servers, PrivateRedis(os.path.join(workdir, "single"))).url}
        if a.cluster:
            targets["cluster"] = _started(servers, PrivateRedisCluster(os.path.join(workdir, "cluster"))).url
        out: dict = {"processes": a.processes, "chunk_mib": a.chunk_mib, "chunks_per_process": a.chunks,
                     "level": a.level}
        ctx = multiprocessing.get_context("spawn")
        for label, url in targets.items():
            barrier, results = ctx.Barrier(a.processes), ctx.Queue()
            procs = [ctx.Process(target=_child, args=(url, a, i, barrier, results)) for i in range(a.processes)]
            for p in procs:
                p.start()
            runs = [results.get(timeout=600) for _ in procs]
            for p in procs:
                p.join()
            if any(isinstance(r, str) for r in runs):
                raise RuntimeError("a benchmark process failed: " + next(r for r in runs if isinstance(r, str)))
            best: dict[str, float] = {}
            for rep in range(a.repeats):  # phase p of every process: total bytes / (last end - first start)
                for phase in ("put", "get"):
                    spans = [r[rep][phase] for r in runs]
                    gbps = sum(b for b, _, _ in spans) / (max(e for _, _, e in spans) - min(t for _, t, _ in spans))
                    best[f"{phase}_gbps"] = max(best.get(f"{phase}_gbps", 0.0), gbps / 1e9)
            out[label] = {k: round(v, 3) for k, v in best.items()}
        return out
    finally:
        for srv in servers:
            srv.kill()
        shutil.rmtree(workdir, ignore_errors=True)


def _started(servers: list, server: object) -> object:
    servers.append(server)
    return server


def _child(url: str, a: argparse.Namespace, index: int, barrier: object, results: object) -> None:
    try:
        results.put(_one_process(url, a, index, barrier))  # type: ignore[attr-defined]
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises
        barrier.abort()  # type: ignore[attr-defined]
        results.put(f"{type(e).__name__}: {e}")  # type: ignore[attr-defined]


def _one_process(url: str, a: argparse.Namespace, index: int, barrier: object) -> list[dict]:
    """One process's repeats: [{"put": (raw bytes, start, end), "get": (...)}], its phases started together."""
    chunks, keys, name, store, chain = _setup(url, a, f"{index}-")
    raw = sum(map(len, chunks))
    out = []
    try:
        for _ in range(a.repeats):
            rep = {}
            barrier.wait()  # type: ignore[attr-defined]
            t0 = time.time()
            for k, c in zip(keys, chunks):
                assert chain.remote.put_encoded(k, NS, fmt.encode(k, NS, c, element_size=2, level=a.level))
            rep["put"] = (raw, t0, time.time())
            store.clear()
            barrier.wait()  # type: ignore[attr-defined]
            t0 = time.time()
            assert chain.promote(keys, [NS] * len(keys)) == len(keys)
            rep["get"] = (raw, t0, time.time())
            out.append(rep)
        return out
    finally:
        for k in keys:
            chain.remote.remove(k, NS)
        chain.close()
        store.close()
        drop_cache(name)


def report(r: dict) -> None:
    if "single" in r:
        for label in ("single", "cluster"):
            if label in r:
                print(f"remote tier, {label}: {r['processes']} processes x {r['chunks_per_process']} chunks of "
                      f"{r['chunk_mib']} MiB: put {r[label]['put_gbps']:.3f} GB/s, get {r[label]['get_gbps']:.3f} "
                      "GB/s raw, aggregate")
        return
    print(f"remote tier via {r['server']}: {r['chunks']} chunks of {r['chunk_mib']} MiB, zstd level {r['level']}, "
          f"ratio {r['ratio']}")
    print(f"  put  {r['put_gbps']:.3f} GB/s raw (encode + SET); SET alone {r['wire_put_gbps']:.3f} GB/s encoded")
    print(f"  get  {r['get_gbps']:.3f} GB/s raw (GET + decode + put); GET alone {r['wire_get_gbps']:.3f} GB/s encoded")
