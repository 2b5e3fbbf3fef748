"""Gather/scatter GB/s against memcpy of the same bytes in the same run.

CPU: vLLM 0.32's CPU layout [num_blocks, kv_heads, block_size, 2*head] with a
Llama-3-8B-like shape (32 layers, 8 KV heads, head 128, bf16, block 128): one
256-token chunk is 32 MiB, copied as 64 runs of 512 KiB, into/out of a chunk
in a shmkv segment. GPU (when one is present): the same shape in the CUDA NHD
layout, device cache <-> registered segment, against pinned cudaMemcpy.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid

import numpy as np
import torch

from shmkv import Store
from shmkv.bench import drop_cache
from shmkv.bench.baselines import memcpy_baselines
from shmkv.transfer.layout import KVLayout

MiB = 1 << 20


SLOTS = 6  # chunks the benchmark rotates through (and the cold memcpy baseline too)


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_cpu(layers: int, heads: int, head: int, bs: int, chunk: int, blocks: int,
              repeats: int) -> dict[str, float]:
    shape = (blocks, heads, bs, 2 * head)
    flat = torch.zeros(layers * blocks * heads * bs * 2 * head, dtype=torch.bfloat16)
    flat.view(torch.int16).random_()
    per = blocks * heads * bs * 2 * head
    cache = [flat[i * per:(i + 1) * per].view(shape) for i in range(layers)]
    layout = KVLayout("cpu", cache)
    nbytes = layout.payload_bytes(chunk)
    name = f"shmkv-bench-{uuid.uuid4().hex[:8]}"
    store = Store.create(name, SLOTS * nbytes + 64 * MiB, max_payload_bytes=nbytes)
    try:
        rng = np.random.default_rng(0)
        # rotate through SLOTS chunks of the segment, as a store of many chunks does
        rs = [store.reserve(bytes([i + 1]) * 16, nbytes) for i in range(SLOTS)]
        payloads = [r.numpy() for r in rs]
        for view in payloads:
            view[:] = 0  # faulted in, like the store's populate
        del view  # NOTE: a view left alive keeps its reservation open: close() would refuse
        base = memcpy_baselines(nbytes, SLOTS, repeats * 2)
        id_sets = [rng.permutation(blocks)[: chunk // bs].astype(np.int64) for _ in range(repeats)]
        it = iter(range(1 << 30))

        def gather() -> None:
            i = next(it)
            layout.gather(id_sets[i % repeats], rs[i % SLOTS])

        gather_s = _median_s(gather, max(repeats, 2 * SLOTS))
        it2 = iter(range(1 << 30))
        last = [0]

        def scatter() -> None:
            i = last[0] = next(it2)
            layout.scatter(id_sets[i % repeats], rs[i % SLOTS])

        scatter_s = _median_s(scatter, max(repeats, 2 * SLOTS))
        # correctness spot check: the last scatter wrote what its payload holds
        ids = id_sets[last[0] % repeats]
        assert bytes(cache[layers - 1][ids[-1]].view(torch.uint8).reshape(-1)[-64:].numpy()) == \
            bytes(payloads[last[0] % SLOTS][-64:])
        del payloads
        for r in rs:
            r.abort()
    finally:
        store.close()
        drop_cache(name)
    gb = nbytes / 1e9
    cold = base["memcpy_cold_gbps"]
    return {"chunk_bytes": nbytes, "slots": SLOTS, **base, "memcpy_gbps": cold, "gather_gbps": gb / gather_s,
            "scatter_gbps": gb / scatter_s, "gather_ratio": gb / gather_s / cold,
            "scatter_ratio": gb / scatter_s / cold}


def bench_gpu(layers: int, heads: int, head: int, bs: int, chunk: int, blocks: int,
              repeats: int) -> dict[str, float]:
    from shmkv.transfer import gpu

    dev = torch.device("cuda")
    shape = (blocks, bs, heads, 2 * head)
    cache = [torch.randn(shape, dtype=torch.bfloat16, device=dev) for _ in range(layers)]
    layout = KVLayout("nhd", cache)
    nbytes = layout.payload_bytes(chunk)
    name = f"shmkv-bench-{uuid.uuid4().hex[:8]}"
    store = Store.create(name, nbytes + 64 * MiB, max_payload_bytes=nbytes)
    gpu.register_segment(store, wait=True)
    try:
        r = store.reserve(b"\x02" * 16, nbytes)
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        devbuf = torch.empty(nbytes, dtype=torch.uint8, device=dev)

        def timed(fn) -> float:
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeats):
                fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3 / repeats

        ids = np.random.default_rng(0).permutation(blocks)[: chunk // bs]
        slots = layout.slots_for_blocks(ids, chunk)
        h2d = timed(lambda: devbuf.copy_(host, non_blocking=True))
        d2h = timed(lambda: host.copy_(devbuf, non_blocking=True))
        gather_s = timed(lambda: layout.gather(slots, r))
        scatter_s = timed(lambda: layout.scatter(slots, r))
        r.abort()
    finally:
        gpu.unregister_segment(store)
        store.close()
        drop_cache(name)
    gb = nbytes / 1e9
    return {"gpu_chunk_bytes": nbytes, "gpu_memcpy_h2d_gbps": gb / h2d, "gpu_memcpy_d2h_gbps": gb / d2h,
            "gpu_gather_gbps": gb / gather_s, "gpu_scatter_gbps": gb / scatter_s,
            "gpu_gather_ratio": d2h / gather_s, "gpu_scatter_ratio": h2d / scatter_s,
            "gpu_name": torch.cuda.get_device_name()}


def run(argv: list[str]) -> dict:
    p = argparse.ArgumentParser(prog="shmkv bench kernels", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--blocks", type=int, default=16)
    p.add_argument("--repeats", type=int, default=20)
    a = p.parse_args(argv)
    shape = (a.layers, a.kv_heads, a.head_size, a.block_size, a.chunk, a.blocks, a.repeats)
    result: dict = {"layout": "cpu:LBHNC", "layers": a.layers, "kv_heads": a.kv_heads,
                    "head_size": a.head_size, "block_size": a.block_size, "chunk_tokens": a.chunk}
    result.update(bench_cpu(*shape))
    if torch.cuda.is_available():
        result.update(bench_gpu(*shape))
    else:
        result["gpu"] = "skipped: no CUDA GPU"
    return result


def report(r: dict) -> None:
    print(f"memcpy baselines: warm single buffer {r['memcpy_warm_gbps']:.1f} GB/s, {r['slots']} rotating cold "
          f"slots {r['memcpy_cold_gbps']:.1f} GB/s (ratios below are against the cold one)")
    print(f"CPU {r['layout']} chunk {r['chunk_bytes'] / MiB:.0f} MiB: memcpy {r['memcpy_gbps']:.1f} GB/s, "
          f"gather {r['gather_gbps']:.1f} GB/s ({r['gather_ratio']:.2f}x), "
          f"scatter {r['scatter_gbps']:.1f} GB/s ({r['scatter_ratio']:.2f}x)")
    if "gpu_gather_gbps" in r:
        print(f"GPU {r['gpu_name']}: cudaMemcpy H2D {r['gpu_memcpy_h2d_gbps']:.1f} / D2H "
              f"{r['gpu_memcpy_d2h_gbps']:.1f} GB/s, gather {r['gpu_gather_gbps']:.1f} GB/s "
              f"({r['gpu_gather_ratio']:.2f}x), scatter {r['gpu_scatter_gbps']:.1f} GB/s "
              f"({r['gpu_scatter_ratio']:.2f}x)")
    else:
        print(r["gpu"])
