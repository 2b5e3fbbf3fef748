"""Disk tier throughput and compression.

  spill_gbps      raw bytes/s written by the maintainer's path (shuffle + zstd + write + rename)
  promote_gbps    raw bytes/s brought back (read + zstd + unshuffle into the reservation + check + commit)
each the median of 5 rounds
  ratio_shuffled  raw / compressed bytes with the byte-plane shuffle
  ratio_plain     the same without it
  codecs          per codec (zstd, none, auto): spill and promote GB/s at 1 and N
                  threads, and for auto what it chose here and why
measured on KV that vLLM computed for a random-weight model (fields `kv_*`)
and on Gaussian bf16 (fields `gauss_*`; the top-level fields are the KV ones).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import tempfile
import time

import torch
import xxhash

from shmkv import PutResult, Store
from shmkv.bench import drop_cache
from shmkv.config import io_threads, load_config
from shmkv.services.maintainer import Maintainer
from shmkv.tiers import format as fmt
from shmkv.tiers import open_tiers

MiB = 1 << 20


def _ratios(chunks: list[bytes], level: int) -> tuple[float, float]:
    raw = sum(len(c) for c in chunks)
    shuf = sum(len(fmt.encode(b"k" * 16, b"n" * 16, c, element_size=2, level=level)) for c in chunks)
    plain = sum(len(fmt.encode(b"k" * 16, b"n" * 16, c, element_size=1, level=level)) for c in chunks)
    return raw / shuf, raw / plain


def _throughput(chunks: list[bytes], workdir: str, level: int, threads: int = 1, codec: str = "zstd",
                choice: dict | None = None, repeat: int = 5) -> tuple[float, float]:
    """Median over `repeat` rounds of (spill, promote) GB/s of raw bytes with
    `threads` chunks at a time (the maintainer's spills in flight and the tier
    chain's parallel fetch); `choice` gets the codec choice's description."""
    name = f"shmkv-bench-disk-{os.getpid()}"
    size = max(len(c) for c in chunks)
    total = sum(map(len, chunks))
    store = Store.create(name, len(chunks) * size + 64 * MiB, max_payload_bytes=size)
    keys = [xxhash.xxh3_128_digest(str(i).encode()) for i in range(len(chunks))]
    spills, proms = [], []
    try:
        for _ in range(repeat):
            shutil.rmtree(os.path.join(workdir, "disk"), ignore_errors=True)
            cfg = load_config({"cache_name": name, "disk_dir": os.path.join(workdir, "disk"), "disk_capacity": 1 << 40,
                               "disk_level": level, "disk_codec": codec, "disk_shuffle_bytes": 2,
                               "io_threads": threads}, env={})
            chain = open_tiers(cfg, store)
            disk = chain.disk
            store.clear()
            for k, c in zip(keys, chunks):
                assert store.put(k, c, namespace=b"n" * 16) is PutResult.OK
            m = Maintainer(chain, threads=threads)
            t0 = time.perf_counter()
            assert m.spill_all() == (len(chunks), 0)
            spills.append(total / (time.perf_counter() - t0) / 1e9)
            m.close()
            store.clear()
            t0 = time.perf_counter()
            assert chain.promote(keys, [b"n" * 16] * len(keys)) == len(keys)
            proms.append(total / (time.perf_counter() - t0) / 1e9)
            chain.close()
            assert store.get(keys[-1]) == chunks[-1]
            if choice is not None:
                choice.update(disk.codec.describe())
        return statistics.median(spills), statistics.median(proms)
    finally:
        store.close()
        drop_cache(name)
        shutil.rmtree(os.path.join(workdir, "disk"), ignore_errors=True)


def _vllm_kv(workdir: str) -> list[bytes]:
    """Chunk payloads vLLM computed for a 3,000-token prompt (tiny random Llama)."""
    from shmkv.engines.engine import EngineProcess, EngineSpec
    from shmkv.engines.models import TEST_MODEL, write_llama

    model = write_llama(os.path.join(workdir, "model"), TEST_MODEL)
    name = f"shmkv-bench-kv-{os.getpid()}"
    rng = random.Random(3)
    prompts = [[rng.randrange(3, TEST_MODEL.vocab_size) for _ in range(3000)] for _ in range(3)]
    try:
        with EngineProcess(EngineSpec(model, shmkv={"cache_name": name, "capacity": "256MiB"}),
                           os.path.join(workdir, "engine.log")) as e:
            e.generate(prompts, max_tokens=1)
        store = Store.attach(name)
        chunks = []
        for key, _size, _flags, _ns, _tokens in store.coldest(1 << 20):
            chunks.append(store.get(key))
        store.close()
        return chunks
    finally:
        drop_cache(name)


def run(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="shmkv bench disk", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--level", type=int, default=1, help="zstd level")
    ap.add_argument("--gauss-chunks", type=int, default=32)
    ap.add_argument("--chunk-mib", type=int, default=8)
    ap.add_argument("--no-vllm", action="store_true", help="skip the vLLM KV part")
    ap.add_argument("--threads", type=int, default=0, help="threads for the N-thread figures (0: io_threads)")
    a = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="shmkv-bench-disk-")
    try:
        g = torch.Generator().manual_seed(0)
        n = a.chunk_mib * MiB // 2
        gauss = [torch.randn(n, generator=g).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
                 for _ in range(a.gauss_chunks)]
        gs, gp = _ratios(gauss, a.level)
        _throughput(gauss[:2], work, a.level)  # warm-up: zstd contexts, first file creations
        g_spill, g_prom = _throughput(gauss, work, a.level)
        n = a.threads or io_threads(load_config({}, env={}))
        g_spill_n, g_prom_n = _throughput(gauss, work, a.level, n)
        codecs = {}
        for codec in ("zstd", "none", "auto"):
            chose: dict = {}
            s1, p1 = (g_spill, g_prom) if codec == "zstd" else _throughput(gauss, work, a.level, 1, codec)
            sn, pn = (g_spill_n, g_prom_n) if codec == "zstd" else _throughput(gauss, work, a.level, n, codec, chose)
            codecs[codec] = {"spill_gbps": s1, "promote_gbps": p1, "spill_gbps_n_threads": sn,
                             "promote_gbps_n_threads": pn, **({"chose": chose} if codec == "auto" else {})}
        out = {"level": a.level, "gauss_ratio_shuffled": gs, "gauss_ratio_plain": gp, "codecs": codecs,
               "gauss_spill_gbps": g_spill, "gauss_promote_gbps": g_prom,
               "threads": n, "gauss_spill_gbps_n_threads": g_spill_n, "gauss_promote_gbps_n_threads": g_prom_n,
               "spill_speedup": g_spill_n / g_spill, "promote_speedup": g_prom_n / g_prom,
               "gauss_chunk_bytes": len(gauss[0])}
        if not a.no_vllm:
            kv = _vllm_kv(work)
            ks, kp = _ratios(kv, a.level)
            k_spill, k_prom = _throughput(kv, work, a.level)
            out.update({"kv_chunks": len(kv), "kv_chunk_bytes": len(kv[0]), "kv_ratio_shuffled": ks,
                        "kv_ratio_plain": kp, "kv_spill_gbps": k_spill, "kv_promote_gbps": k_prom})
        src = "kv" if "kv_ratio_shuffled" in out else "gauss"
        out.update({"spill_gbps": out[f"{src}_spill_gbps"], "promote_gbps": out[f"{src}_promote_gbps"],
                    "ratio_shuffled": out[f"{src}_ratio_shuffled"], "ratio_plain": out[f"{src}_ratio_plain"],
                    "source": src})
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)


def report(r: dict) -> None:
    for codec, c in r["codecs"].items():
        extra = f" (chose {c['chose']['choice']}: {c['chose']['reason']})" if "chose" in c else ""
        print(f"codec {codec:5s}: spill {c['spill_gbps']:.2f} -> {c['spill_gbps_n_threads']:.2f} GB/s, promote "
              f"{c['promote_gbps']:.2f} -> {c['promote_gbps_n_threads']:.2f} GB/s (1 -> {r['threads']} threads)"
              f"{extra}")
    print(f"Gaussian bf16 with {r['threads']} threads: spill {r['gauss_spill_gbps_n_threads']:.2f} GB/s "
          f"({r['spill_speedup']:.2f}x one thread), promote {r['gauss_promote_gbps_n_threads']:.2f} GB/s "
          f"({r['promote_speedup']:.2f}x)")
    for src, label in (("kv", "vLLM KV (random Llama)"), ("gauss", "Gaussian bf16")):
        if f"{src}_ratio_shuffled" in r:
            print(f"{label:24s} ratio {r[f'{src}_ratio_shuffled']:.3f} shuffled / {r[f'{src}_ratio_plain']:.3f} "
                  f"plain; spill {r[f'{src}_spill_gbps']:.2f} GB/s, promote {r[f'{src}_promote_gbps']:.2f} GB/s")
