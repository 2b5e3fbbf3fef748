"""Remote tier throughput through Redis, on loopback and over a slower link.

For each codec setting of the tier (`--codecs`, default auto, zstd, none:
`remote_codec`), the tier's own write path and its promotion:

  put_gbps        raw bytes/s through tier.write (the codec the setting picks, then SET)
  get_gbps        raw bytes/s through promotion (GET + checks + decode + put into the segment)
  put_of_wire     put_gbps / wire_put_gbps: 1.0 is a tier as fast as its link
  get_of_wire     the same for get
  codec           what the tier wrote with at the end (auto: its choice and why)
  ratio           raw / stored bytes

beside the link alone (wire_put_gbps, wire_get_gbps: SET and GET of raw
chunks by a minimal client, the bytes straight between one buffer and the
socket). `--link-mbps N` puts a rate-limited proxy (shmkv.bench.slow_link)
between the tier and Redis, every byte of the run through it, as a host's
network would be. Chunks are Gaussian bf16 (KV-like). Without --url a
private redis-server (or valkey-server) is started on a free loopback port
and stopped afterwards.

With --cluster the same run also starts a private Redis Cluster (3 primaries)
and measures both, each with --processes processes writing and promoting
their own chunks at once (each with its own segment, as hosts would):
{"single": {...}, "cluster": {...}} of aggregate put_gbps / get_gbps.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import tempfile
import time
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
import torch
import xxhash

from shmkv import Store
from shmkv.bench import drop_cache
from shmkv.bench.slow_link import SlowLink
from shmkv.config import load_config
from shmkv.engines.redis_server import PrivateRedis
from shmkv.names import CODEC_SETTINGS
from shmkv.tiers import format as fmt
from shmkv.tiers import open_tiers

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
    ap.add_argument("--codecs", default="auto,zstd,none", help="remote_codec settings to measure, comma-separated")
    ap.add_argument("--link-mbps", type=float, default=0.0,
                    help="carry every byte through a link of this many MB/s each way (0: loopback as it is)")
    a = ap.parse_args(argv)
    if a.cluster or a.processes > 1:
        return _parallel(a)
    codecs = [c for c in a.codecs.split(",") if c]
    for c in codecs:
        if c not in CODEC_SETTINGS:
            raise SystemExit(f"--codecs: {c!r} is not one of {', '.join(CODEC_SETTINGS)}")

    workdir = tempfile.mkdtemp(prefix="shmkv-bench-remote-")
    link = None
    try:
        server = None if a.url else PrivateRedis(workdir)
    except FileNotFoundError as e:
        raise SystemExit(f"{e}; or pass --url") from e
    try:
        url = a.url or server.url  # type: ignore[union-attr]
        if a.link_mbps:
            parsed = urlsplit(url)
            link = SlowLink(parsed.hostname or "127.0.0.1", parsed.port or 6379, a.link_mbps * 1e6)
            url = urlunsplit(parsed._replace(netloc=f"127.0.0.1:{link.port}"))
        result: dict[str, Any] = {"chunk_mib": a.chunk_mib, "chunks": a.chunks, "level": a.level,
                                  "link": f"{a.link_mbps:g} MB/s" if a.link_mbps else "loopback",
                                  "server": "private redis-server" if server else a.url}
        result.update(_wire(url, a))
        result["codecs"] = {c: _codec_run(url, a, c, result) for c in codecs}
        if "auto" in result["codecs"]:  # the headline: the default setting
            result.update({k: result["codecs"]["auto"][k] for k in ("put_gbps", "get_gbps", "ratio")})
        return result
    finally:
        if link is not None:
            link.close()
        if server is not None:
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def _wire(url: str, a: argparse.Namespace) -> dict[str, float]:
    """The link alone: best GB/s of SET and of GET of raw chunks, by a
    minimal RESP client on one socket (the value sent from and read into one
    buffer: no client library's parsing between the bytes and the link).
    A URL with a password or TLS: measured with redis-py instead."""
    size = int(a.chunk_mib * MiB) // 2 * 2
    chunks = [os.urandom(size) for _ in range(min(a.chunks, 8))]
    nbytes = len(chunks) * size
    parsed = urlsplit(url)
    if parsed.scheme != "redis" or parsed.password:
        return _wire_redis_py(url, chunks)
    sock = socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or 6379), timeout=300)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    names = [f"shmkv-bench-wire-{i}".encode() for i in range(len(chunks))]
    buf = bytearray(size + 64)
    best: dict[str, float] = {}

    def command(*parts: bytes) -> bytes:
        return b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)

    def reply_line() -> bytes:
        line = b""
        while not line.endswith(b"\r\n"):
            line += sock.recv(1)
        return line

    try:
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            for n, c in zip(names, chunks):
                sock.sendall(b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(n), n, size))
                sock.sendall(c)
                sock.sendall(b"\r\n")
                assert reply_line() == b"+OK\r\n"
            best["wire_put_gbps"] = max(best.get("wire_put_gbps", 0.0), nbytes / (time.perf_counter() - t0) / 1e9)
            t0 = time.perf_counter()
            for n in names:
                sock.sendall(command(b"GET", n))
                assert reply_line() == b"$%d\r\n" % size
                view, got = memoryview(buf), 0
                while got < size + 2:
                    got += sock.recv_into(view[got:size + 2])
            best["wire_get_gbps"] = max(best.get("wire_get_gbps", 0.0), nbytes / (time.perf_counter() - t0) / 1e9)
        sock.sendall(command(b"DEL", *names))
        reply_line()
    finally:
        sock.close()
    return {k: round(v, 3) for k, v in best.items()}


def _wire_redis_py(url: str, chunks: list[bytes]) -> dict[str, float]:
    client = redis.Redis.from_url(url, socket_timeout=300)
    nbytes = sum(map(len, chunks))
    try:
        t0 = time.perf_counter()
        for i, c in enumerate(chunks):
            client.set(f"shmkv-bench-wire-{i}", c)
        put = nbytes / (time.perf_counter() - t0) / 1e9
        t0 = time.perf_counter()
        for i in range(len(chunks)):
            assert client.get(f"shmkv-bench-wire-{i}") is not None
        get = nbytes / (time.perf_counter() - t0) / 1e9
    finally:
        client.delete(*[f"shmkv-bench-wire-{i}" for i in range(len(chunks))])
        client.close()
    return {"wire_put_gbps": round(put, 3), "wire_get_gbps": round(get, 3)}


def _codec_run(url: str, a: argparse.Namespace, codec: str, wire: dict[str, float]) -> dict[str, Any]:
    """The tier with remote_codec=`codec`: best of a.repeats passes of put (tier.write) and get (promote)."""
    chunks, keys, name, store, chain = _setup(url, a, "", codec)
    raw = sum(map(len, chunks))
    tier = chain.remote
    best: dict[str, float] = {}
    stored = 0
    try:
        for _ in range(a.repeats):
            tier.clear(NS)
            sent = store.stats()["remote_put_bytes"]
            t0 = time.perf_counter()
            for k, c in zip(keys, chunks):
                assert tier.write(k, NS, c), "remote write failed"
            best["put_gbps"] = max(best.get("put_gbps", 0.0), raw / (time.perf_counter() - t0) / 1e9)
            stored = store.stats()["remote_put_bytes"] - sent  # the bytes the tier put on the wire
            store.clear()
            t0 = time.perf_counter()
            assert chain.promote(keys, [NS] * len(keys)) == len(keys)
            best["get_gbps"] = max(best.get("get_gbps", 0.0), raw / (time.perf_counter() - t0) / 1e9)
            assert store.get(keys[-1]) == chunks[-1] and store.get(keys[0]) == chunks[0]
        out: dict[str, Any] = {k: round(v, 3) for k, v in best.items()}
        out["put_of_wire"] = round(best["put_gbps"] / wire["wire_put_gbps"], 3)
        out["get_of_wire"] = round(best["get_gbps"] / wire["wire_get_gbps"], 3)
        out["ratio"] = round(raw / stored, 3) if stored else None
        out["codec"] = f"{tier.codec.choice} ({tier.codec.reason})" if codec == "auto" else codec
        return out
    finally:
        tier.clear(NS)
        chain.close()
        store.close()
        drop_cache(name)


def _setup(url: str, a: argparse.Namespace, tag: str, codec: str = "zstd") -> tuple[list[bytes], list[bytes], str,
                                                                                    Store, Any]:
    """(Gaussian bf16 chunks, their keys, segment name, segment, tier chain) of one benchmark process."""
    size = int(a.chunk_mib * MiB) // 2 * 2
    g = torch.Generator().manual_seed(len(tag))
    chunks = [torch.randn(size // 2, generator=g).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
              for _ in range(a.chunks)]
    keys = [xxhash.xxh3_128_digest(f"bench-{tag}{i}".encode()) for i in range(a.chunks)]
    name = f"shmkv-bench-remote-{os.getpid()}"
    store = Store.create(name, a.chunks * size + 64 * MiB, max_payload_bytes=size, populate=False)
    chain = open_tiers(load_config({"cache_name": name, "remote_url": url, "remote_timeout": 300, "disk_level": a.level,
                                    "disk_shuffle_bytes": 2, "remote_codec": codec}, env={}), store)
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
    print(f"remote tier via {r['server']} over {r['link']}: {r['chunks']} chunks of {r['chunk_mib']} MiB, zstd level "
          f"{r['level']}; the link alone: SET {r['wire_put_gbps']:.3f} GB/s, GET {r['wire_get_gbps']:.3f} GB/s")
    for codec, c in r["codecs"].items():
        print(f"  remote_codec={codec}: put {c['put_gbps']:.3f} GB/s raw ({c['put_of_wire']:.2f} of the wire), get "
              f"{c['get_gbps']:.3f} GB/s raw ({c['get_of_wire']:.2f}), ratio {c['ratio']}, wrote {c['codec']}")
