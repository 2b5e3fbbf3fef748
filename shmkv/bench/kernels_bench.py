"""Gather/scatter GB/s against memcpy of the same bytes in the same run.

CPU: every layout shmkv copies (shmkv.transfer.layout.KINDS but kv_split) with a
Llama-3-8B-like shape (32 layers, 8 KV heads, head 128, bf16, block 128; MLA:
a 576-wide latent in CPU_MLA's 16-token blocks; `state`: a linear-attention
group's 64 KiB per block), one 256-token chunk into/out of a chunk in a shmkv
segment, against a cold memcpy of the same bytes between the same kinds of
memory (a process buffer and a /dev/shm mapping), measured beside each
layout at its size. `warm`: the segment's pages already faulted in (as the
store's populate leaves them); `cold` (gather): each copy the first touch of
segment pages this process has not mapped yet (reserved, populate off: a
case shmkv's default, populate on attach, never has), also against a memcpy
into first-touched /dev/shm pages (each page's fault is most of its cost).
Each round measures the baseline and every layout again, the layouts in a
rotated order; the figures are medians over rounds with their range, and
the copying thread's CPU seconds per GB. GPU (when one is present): the
same shape in the CUDA NHD layout, device cache <-> registered segment,
against pinned cudaMemcpy.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from typing import Any

import numpy as np
import torch

from shmkv import PutResult, Store
from shmkv.bench import drop_cache
from shmkv.bench.baselines import memcpy_baselines
from shmkv.transfer.layout import KVLayout

MiB = 1 << 20

SLOTS = 6  # chunks the benchmark rotates through (and the cold memcpy baseline too)
CPU_LAYOUTS = ("cpu", "nhd", "hnd", "mla", "state")
MLA_BLOCK, MLA_LATENT = 16, 576  # vLLM-CPU's CPU_MLA block size; DeepSeek's kv_lora_rank + rope dims
STATE_BYTES = 64 << 10  # a linear-attention block's recurrent state


def _shape(kind: str, blocks: int, heads: int, head: int, bs: int) -> tuple[int, ...]:
    if kind == "cpu":
        return (blocks, heads, bs, 2 * head)
    if kind == "nhd":
        return (blocks, bs, heads, 2 * head)
    if kind == "hnd":
        return (blocks, heads, bs, 2 * head)
    if kind == "mla":
        return (blocks * bs // MLA_BLOCK, MLA_BLOCK, MLA_LATENT)
    if kind == "state":
        return (blocks * 64, STATE_BYTES // 2)
    raise ValueError(f"layout {kind!r}: expected one of {', '.join(CPU_LAYOUTS)}")


class CpuCase:
    """One layout's cache (random bytes) and the indexes of `repeats` chunks in random block orders."""

    def __init__(self, kind: str, layers: int, heads: int, head: int, bs: int, chunk: int, blocks: int,
                 repeats: int, rng: np.random.Generator) -> None:
        shape = _shape(kind, blocks, heads, head, bs)
        per = int(np.prod(shape))
        flat = torch.empty(layers * per, dtype=torch.bfloat16)
        flat.view(torch.int16).random_()
        self.kind = kind
        self.cache = [flat[i * per:(i + 1) * per].view(shape) for i in range(layers)]
        self.layout = KVLayout(kind, self.cache)
        tokens = 1 if kind == "state" else chunk  # a state group holds one block per chunk
        self.nbytes = self.layout.payload_bytes(tokens)
        n = shape[0]
        if self.layout.token_mode:
            per_block = self.layout.block_size
            self.indexes = [self.layout.slots_for_blocks(rng.permutation(n)[: -(-tokens // per_block)], tokens)
                            for _ in range(repeats)]
        else:
            self.indexes = [rng.permutation(n)[: chunk // bs].astype(np.int64) for _ in range(repeats)]


def _copy_rates(case: CpuCase, store: Store, op: str, fresh: bool, repeats: int) -> dict[str, float]:
    """Median GB/s of `op` ("gather" or "scatter") and the thread's CPU s/GB
    over `repeats` copies: rotating through SLOTS faulted-in chunks of
    `store`, or (`fresh`, gather only) each into a chunk of its own whose
    pages nothing has touched yet (all held to the end, so no reservation
    reuses another's pages)."""
    walls, cpus = [], []
    rs = []
    try:
        for _ in range(repeats if fresh else SLOTS):
            r = store.reserve(uuid.uuid4().bytes, case.nbytes)
            if isinstance(r, PutResult):
                raise RuntimeError(f"bench kernels: no room for a {case.nbytes}-byte chunk of {case.kind} ({r.name})")
            rs.append(r)
        if not fresh:
            for r in rs:
                view = r.numpy()
                view[:] = 0  # faulted in, like the store's populate
                del view  # NOTE: a view left alive keeps its reservation open: abort() would refuse
        copy = case.layout.gather if op == "gather" else case.layout.scatter
        for i in range(repeats):
            idx = case.indexes[i % len(case.indexes)]
            c0, t0 = time.thread_time(), time.perf_counter()
            copy(idx, rs[i % len(rs)])
            walls.append(time.perf_counter() - t0)
            cpus.append(time.thread_time() - c0)
    finally:
        for r in rs:
            r.abort()
    gb = case.nbytes / 1e9
    return {f"{op}_gbps": gb / statistics.median(walls), f"{op}_cpu_s_per_gb": statistics.median(cpus) / gb}


VARIANTS = (("warm", "gather"), ("warm", "scatter"), ("cold", "gather"))


def bench_cpu(layers: int, heads: int, head: int, bs: int, chunk: int, blocks: int, repeats: int,
              rounds: int = 1, kinds: tuple[str, ...] = CPU_LAYOUTS, cold: bool = True) -> dict[str, Any]:
    """`cold`: also the gather into pages not yet mapped (a segment of `repeats` chunks beside the warm one)."""
    rng = np.random.default_rng(0)
    cases = [CpuCase(k, layers, heads, head, bs, chunk, blocks, repeats, rng) for k in kinds]
    biggest = max(c.nbytes for c in cases)
    samples: dict[str, dict[str, list[float]]] = {c.kind: {} for c in cases}
    base: dict[str, list[float]] = {}
    warm_name, cold_name = (f"shmkv-bench-{uuid.uuid4().hex[:8]}" for _ in range(2))
    cold_size = (repeats + 2) * biggest + 128 * MiB
    try:
        warm = Store.create(warm_name, SLOTS * biggest + 64 * MiB, max_payload_bytes=biggest)
        try:
            for rnd in range(rounds):
                order = cases[rnd % len(cases):] + cases[: rnd % len(cases)]  # rotated: no layout always first
                for case in order:
                    # the baseline of this case's size, measured beside it
                    cold_memcpy = memcpy_baselines(case.nbytes, SLOTS, repeats, first_touch=cold)
                    for k, v in cold_memcpy.items():
                        base.setdefault(k if case.nbytes == biggest else f"{k}@{case.kind}", []).append(v)
                    for variant, op in VARIANTS:
                        if variant == "cold" and not cold:
                            continue
                        if variant == "cold":  # its pages reserved (allocated), none mapped in this process yet
                            store = Store.create(cold_name, cold_size, max_payload_bytes=biggest, populate=False,
                                                 background_reserve=False)
                            store.reserve_more(cold_size, map_pages=False)
                        else:
                            store = warm
                        try:
                            got = _copy_rates(case, store, op, variant == "cold", repeats)
                        finally:
                            if variant == "cold":
                                store.close()
                                drop_cache(cold_name)
                        into = samples[case.kind]
                        into.setdefault(f"{variant}_{op}_gbps", []).append(got[f"{op}_gbps"])
                        into.setdefault(f"{variant}_{op}_cpu_s_per_gb", []).append(got[f"{op}_cpu_s_per_gb"])
                        into.setdefault(f"{variant}_{op}_ratio", []).append(
                            got[f"{op}_gbps"] / cold_memcpy["memcpy_cold_gbps"])
                        if variant == "cold":  # like with like: a memcpy into first-touched pages too
                            into.setdefault(f"cold_{op}_ratio_first_touch", []).append(
                                got[f"{op}_gbps"] / cold_memcpy["memcpy_first_touch_gbps"])
            # correctness spot check: every layout's scatter then gather gives back the payload's bytes
            for case in cases:
                r = warm.reserve(uuid.uuid4().bytes, case.nbytes)
                try:
                    view = r.numpy()
                    view[:] = np.random.default_rng(1).integers(0, 255, case.nbytes, dtype=np.uint8)
                    case.layout.scatter(case.indexes[0], r)
                    back = torch.empty(case.nbytes, dtype=torch.uint8)
                    case.layout.gather(case.indexes[0], back)
                    assert np.array_equal(back.numpy(), view), f"{case.kind}: scatter then gather changed bytes"
                    del view
                finally:
                    r.abort()
        finally:
            warm.close()
    finally:
        drop_cache(warm_name)
        drop_cache(cold_name)
    med = {k: statistics.median(v) for k, v in base.items() if "@" not in k}
    layouts = {kind: {k: _spread(v) for k, v in got.items()} for kind, got in samples.items()}
    out: dict[str, Any] = {"rounds": rounds, "slots": SLOTS, "chunk_bytes": {c.kind: c.nbytes for c in cases},
                           "memcpy": {k: _spread(v) for k, v in base.items()}, **med,
                           "memcpy_gbps": med["memcpy_cold_gbps"], "layouts": layouts}
    if "cpu" in layouts:  # the headline figures: vLLM-CPU's own layout, warm segment
        cpu = layouts["cpu"]
        out.update(gather_gbps=cpu["warm_gather_gbps"]["median"], scatter_gbps=cpu["warm_scatter_gbps"]["median"],
                   gather_ratio=cpu["warm_gather_ratio"]["median"], scatter_ratio=cpu["warm_scatter_ratio"]["median"])
    return out


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3),
            "max": round(max(values), 3), "n": len(values)}


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
    p.add_argument("--repeats", type=int, default=20, help="copies per layout, variant and round")
    p.add_argument("--rounds", type=int, default=5, help="rounds (memcpy and every layout each, rotated)")
    p.add_argument("--layouts", default=",".join(CPU_LAYOUTS), help="the CPU layouts, comma-separated")
    a = p.parse_args(argv)
    kinds = tuple(k for k in a.layouts.split(",") if k)
    for k in kinds:
        _shape(k, 1, 1, 1, MLA_BLOCK)  # an unknown layout fails before anything runs
    shape = (a.layers, a.kv_heads, a.head_size, a.block_size, a.chunk, a.blocks, a.repeats)
    result: dict = {"layout": "cpu:LBHNC", "layers": a.layers, "kv_heads": a.kv_heads,
                    "head_size": a.head_size, "block_size": a.block_size, "chunk_tokens": a.chunk}
    result.update(bench_cpu(*shape, rounds=a.rounds, kinds=kinds))
    if torch.cuda.is_available():
        result.update(bench_gpu(*shape))
    else:
        result["gpu"] = "skipped: no CUDA GPU"
    return result


def report(r: dict) -> None:
    m = r["memcpy"]
    print(f"memcpy baselines over {r['rounds']} rounds: warm single buffer {m['memcpy_warm_gbps']['median']:.1f} "
          f"GB/s, {r['slots']} rotating cold slots {m['memcpy_cold_gbps']['median']:.1f} GB/s "
          f"({m['memcpy_cold_gbps']['min']:.1f}-{m['memcpy_cold_gbps']['max']:.1f}; ratios below are against the "
          "cold one of each layout's size, measured beside it"
          + (f"; into first-touched pages {m['memcpy_first_touch_gbps']['median']:.1f} GB/s"
             if "memcpy_first_touch_gbps" in m else "") + ")")
    for kind, got in r["layouts"].items():
        parts = []
        for variant, op in VARIANTS:
            if f"{variant}_{op}_ratio" not in got:
                continue
            ratio = got[f"{variant}_{op}_ratio"]
            first = got.get(f"cold_{op}_ratio_first_touch") if variant == "cold" else None
            parts.append(f"{variant} {op} {got[f'{variant}_{op}_gbps']['median']:.1f} GB/s "
                         f"{ratio['median']:.2f}x ({ratio['min']:.2f}-{ratio['max']:.2f})"
                         + (f" [{first['median']:.2f}x of a first-touch memcpy ({first['min']:.2f}-"
                            f"{first['max']:.2f})]" if first else "")
                         + f", {got[f'{variant}_{op}_cpu_s_per_gb']['median']:.3f} CPU s/GB")
        print(f"CPU {kind} ({r['chunk_bytes'][kind] / MiB:.1f} MiB): " + "; ".join(parts))
    if "gpu_gather_gbps" in r:
        print(f"GPU {r['gpu_name']}: cudaMemcpy H2D {r['gpu_memcpy_h2d_gbps']:.1f} / D2H "
              f"{r['gpu_memcpy_d2h_gbps']:.1f} GB/s, gather {r['gpu_gather_gbps']:.1f} GB/s "
              f"({r['gpu_gather_ratio']:.2f}x), scatter {r['gpu_scatter_gbps']:.1f} GB/s "
              f"({r['gpu_scatter_ratio']:.2f}x)")
    else:
        print(r["gpu"])
