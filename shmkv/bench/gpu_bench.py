"""The CUDA path through the connector's worker (not the raw kernels), against
pinned cudaMemcpy of the same bytes in the same run. Without a CUDA GPU (or
without shmkv._C_cuda) it says so on one line and exits 0.

Shape: a FlashAttention-sized cache, 32 layers of vLLM's view [blocks, 8 KV
heads, 16-token blocks, K and V of a 128-wide head] bf16 in NHD order;
256-token chunks of 32 MiB, 16 of them.

  store_gbps            TransferEngine.store of 16 chunks, until every one is committed
  load_gbps, load_ms    TransferEngine.submit_load of those 16 chunks until its leases are released into other blocks
                        (top level: the default engines, stores by DMA and loads by
                        kernels; "engines": both candidates for each direction)
  first_layer_ready_ms  from start_load to the first layer's CUDA event
  h2d_gbps, d2h_gbps    pinned cudaMemcpy of the same 512 MiB
  overlap_slowdown      a compute-bound loop (bf16 matmuls) with the 16 stores issued
                        beside it, over the loop alone
  create_gbps, ready_s  segment creation (shmkv.bench.segment), --segment-gib
  register_s_per_gib    cudaHostRegister of the segment's arena, per GiB
  layout_cases          per layout case (token- or head-major order, 1, 2 or 8 KV heads,
                        consecutive or fragmented block ids): store and load GB/s of each
                        copy engine, and what "auto" (the default) picks
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid

from shmkv.bench import drop_cache

MiB, GiB = 1 << 20, 1 << 30
LAYERS, HEADS, BS, CONTENT = 32, 8, 16, 256  # CONTENT: bf16 values per head and token (K and V)
CHUNK_TOKENS, CHUNKS = 256, 16


def run(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="shmkv bench gpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--segment-gib", type=int, default=32, help="segment size for create/ready/register")
    ap.add_argument("--matmul", type=int, default=8192, help="matrix size of the compute-bound loop")
    a = ap.parse_args(argv)
    from shmkv.transfer.gpu import unavailable

    why = unavailable()
    if why is not None:
        return {"skipped": why}
    out = worker_figures(a.repeats, a.matmul)
    out["layout_cases"] = _layout_cases(a.repeats)
    out.update(segment_figures(a.segment_gib))
    out["load_gbps_over_h2d"] = out["load_gbps"] / out["h2d_gbps"]
    out["store_gbps_over_d2h"] = out["store_gbps"] / out["d2h_gbps"]
    out["first_layer_target_ms"] = out["load_ms"] / LAYERS + 1
    return out


def worker_figures(repeats: int, n: int) -> dict:
    """The connector worker's CUDA path (module doc: stores, loads, pinned
    cudaMemcpy, the slowdown of `n`x`n` bf16 matmuls beside the stores, the
    layout cases), medians over `repeats`: `bench gpu`'s figures and those
    `shmkv check` reports."""
    import torch

    from shmkv import Store
    from shmkv.config import load_config
    from shmkv.integration.vllm.engine_inputs import KVGroup
    from shmkv.integration.vllm.worker import WorkerSide
    from shmkv.transfer import GroupWindow, LoadItem, StoreItem

    dev = torch.device("cuda", 0)
    blocks_per_chunk = CHUNK_TOKENS // BS
    num_blocks = 2 * CHUNKS * blocks_per_chunk + 8
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    # NHD physical order, seen through vLLM's [blocks, heads, block tokens, content] view
    caches = {nm: torch.randn(num_blocks, BS, HEADS, CONTENT, device=dev, dtype=torch.bfloat16).permute(0, 2, 1, 3)
              for nm in names}
    chunk_bytes = LAYERS * CHUNK_TOKENS * HEADS * CONTENT * 2
    total = CHUNKS * chunk_bytes
    name = f"shmkv-bench-gpu-{uuid.uuid4().hex[:8]}"
    store = Store.create(name, 4 * total + GiB, max_payload_bytes=chunk_bytes)
    store.wait_reserved(timeout_s=600)
    try:
        side = WorkerSide(load_config({"cache_name": name}, env={}), store, [KVGroup(tuple(names))], 0, BS)
        side.register_kv_caches(caches)
        if side.worker is None:
            raise RuntimeError(f"the connector refused the cache: {side.off_reason}")
        w = side.worker
        src = [list(range(i * blocks_per_chunk, (i + 1) * blocks_per_chunk)) for i in range(CHUNKS)]
        dst = [[b + CHUNKS * blocks_per_chunk for b in bl] for bl in src]
        ns = (b"G" * 16,)
        round_no = iter(range(1 << 30))

        def store_items() -> list:
            r = next(round_no)
            return [StoreItem("r", (bytes([r % 256, r // 256 % 256, i]) + b"k" * 13,), CHUNK_TOKENS,
                              (GroupWindow(0, len(b), tuple(b)),), namespaces=ns) for i, b in enumerate(src)]

        def store_all() -> list:
            items = store_items()
            w.store(items)  # issue, wait for every copy, commit
            return items

        def timed(fn):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            got = fn()
            torch.cuda.synchronize()
            return time.perf_counter() - t0, got

        def use(engine: str) -> None:
            for lay in w.layouts:
                lay.copier.engines(store=engine, load=engine)

        def loads_of(items: list) -> tuple[list[float], list[float]]:
            loads = [LoadItem("q", it.keys, (GroupWindow(0, len(b), tuple(b)),)) for it, b in zip(items, dst)]
            first, whole = [], []
            for _ in range(repeats + 1):
                for nm in names:
                    caches[nm][dst[0][0]].zero_()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                job = w.submit_load(loads)
                job.events[0].synchronize()
                t1 = time.perf_counter()
                for nm in names:  # the forward's hooks: each issues the layers after its own
                    job.wait_layer(nm)
                job.synchronize()
                [(_, failed)] = w.poll_loads()
                t2 = time.perf_counter()
                if failed:
                    raise RuntimeError(f"{len(failed)} blocks failed to load")
                first.append(t1 - t0)
                whole.append(t2 - t0)
            torch.cuda.synchronize()
            for nm in names:
                if not torch.equal(caches[nm][src[0][0]].view(torch.uint8), caches[nm][dst[0][0]].view(torch.uint8)):
                    raise RuntimeError("the loaded blocks differ from the stored ones")
            return first[1:], whole[1:]

        engines: dict[str, dict] = {}
        for engine in ("dma", "kernel"):
            use(engine)
            store_all()  # warm-up
            store_s = [timed(store_all)[0] for _ in range(repeats)]
            first, whole = loads_of(store_all())
            engines[engine] = {"store_s": store_s, "first": first, "whole": whole}

        host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        devbuf = torch.empty(total, dtype=torch.uint8, device=dev)
        h2d = [timed(lambda: devbuf.copy_(host, non_blocking=True))[0] for _ in range(repeats)]
        d2h = [timed(lambda: host.copy_(devbuf, non_blocking=True))[0] for _ in range(repeats)]

        a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)

        def compute() -> None:
            for _ in range(40):
                a @ b

        timed(compute)
        alone = [timed(compute)[0] for _ in range(repeats)]

        def both() -> None:
            items = store_items()
            w.submit_store(items)  # store stream: issued first, then the compute runs beside it
            compute()
            w.wait_stores()

        med = statistics.median
        for engine in ("dma", "kernel"):
            use(engine)
            e = engines[engine]
            together = [timed(both)[0] for _ in range(repeats)]
            engines[engine] = {
                "store_gbps": total / med(e["store_s"]) / 1e9, "load_gbps": total / med(e["whole"]) / 1e9,
                "load_ms": med(e["whole"]) * 1e3, "first_layer_ready_ms": med(e["first"]) * 1e3,
                "compute_with_stores_ms": med(together) * 1e3, "overlap_slowdown": med(together) / med(alone),
            }
        side.shutdown()
        store_e, load_e = engines["dma"], engines["kernel"]  # what "auto" picks for this shape (long runs)
        return {
            "chunk_bytes": chunk_bytes, "chunks": CHUNKS, "layers": LAYERS, "engines": engines,
            "store_gbps": store_e["store_gbps"], "overlap_slowdown": store_e["overlap_slowdown"],
            "compute_with_stores_ms": store_e["compute_with_stores_ms"],
            "load_gbps": load_e["load_gbps"], "load_ms": load_e["load_ms"],
            "first_layer_ready_ms": load_e["first_layer_ready_ms"],
            "h2d_gbps": total / med(h2d) / 1e9, "d2h_gbps": total / med(d2h) / 1e9,
            "compute_alone_ms": med(alone) * 1e3, "device": torch.cuda.get_device_name(dev),
        }
    finally:
        store.close()
        drop_cache(name)


CASES = [  # (name, physical order, KV heads, fragmented block table)
    ("nhd-8h-consecutive", "nhd", 8, False), ("nhd-8h-fragmented", "nhd", 8, True),
    ("hnd-2h-consecutive", "hnd", 2, False), ("nhd-1h-fragmented", "nhd", 1, True),
    ("hnd-1h-fragmented", "hnd", 1, True),
]


def _layout_cases(repeats: int, layers: int = 8, chunks: int = 8) -> list[dict]:
    """Store and load GB/s of each copy engine through the transfer engine,
    per layout case, and what "auto" picks (copy_backends.choose_dma)."""
    import random

    import torch

    from shmkv import Store
    from shmkv.transfer import GroupWindow, LoadItem, StoreItem, TransferEngine, gpu
    from shmkv.transfer.layout import KVLayout

    dev = torch.device("cuda", 0)
    bpc = CHUNK_TOKENS // BS
    out = []
    for case, order, heads, fragmented in CASES:
        nb = 6 * chunks * bpc + 8
        shape = (nb, BS, heads, CONTENT) if order == "nhd" else (nb, heads, BS, CONTENT)
        caches = [torch.randn(*shape, device=dev, dtype=torch.bfloat16) for _ in range(layers)]
        views = [c.permute(0, 2, 1, 3) if order == "nhd" else c for c in caches]
        ids = list(range(nb))
        if fragmented:
            ids = ids[::3]
            random.Random(0).shuffle(ids)
        src = [ids[i * bpc:(i + 1) * bpc] for i in range(chunks)]
        dst = [ids[(chunks + i) * bpc:(chunks + i + 1) * bpc] for i in range(chunks)]
        chunk_bytes = layers * CHUNK_TOKENS * heads * CONTENT * 2
        name = f"shmkv-bench-gpu-case-{uuid.uuid4().hex[:8]}"
        store = Store.create(name, 4 * chunks * chunk_bytes + 256 * MiB, max_payload_bytes=chunk_bytes)
        store.wait_reserved(timeout_s=600)
        gpu.register_segment(store, wait=True)
        try:
            layout = KVLayout("hnd", views, [f"l{i}" for i in range(layers)], block_size=BS)
            eng = TransferEngine(store, layout, 0)
            row: dict = {"case": case, "chunk_bytes": chunk_bytes}
            slots = [layout.slots_for_blocks(b, CHUNK_TOKENS) for b in src]
            layout.copier.engines(store="auto", load="auto")
            row["auto_store"] = "dma" if layout.copier.use_dma("store", slots, (0, layers)) else "kernel"
            row["auto_load"] = "dma" if layout.copier.use_dma("load", slots, (0, 1)) else "kernel"
            for e, engine in enumerate(("dma", "kernel")):
                layout.copier.engines(store=engine, load=engine)
                st, ld = [], []
                for r in range(repeats + 1):
                    # keys of their own per engine and round: a key already present is not copied again
                    keys = [bytes([e, r, i]) + b"c" * 13 for i in range(chunks)]
                    puts = store.stats()["puts"]
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    eng.store([StoreItem("r", (k,), CHUNK_TOKENS, (GroupWindow(0, bpc, tuple(b)),))
                               for k, b in zip(keys, src)])
                    t1 = time.perf_counter()
                    stored = store.stats()["puts"] - puts
                    if stored != chunks:
                        raise RuntimeError(f"{case} {engine}: {stored} of {chunks} chunks were stored; the "
                                           "timing would not be of copies")
                    job = eng.submit_load([LoadItem("q", (k,), (GroupWindow(0, bpc, tuple(b)),))
                                           for k, b in zip(keys, dst)])
                    job.synchronize()
                    [(_, failed)] = eng.poll_loads()
                    t2 = time.perf_counter()
                    if failed:
                        raise RuntimeError(f"{case}: {len(failed)} blocks failed to load")
                    if r:
                        st.append(t1 - t0)
                        ld.append(t2 - t1)
                total = chunks * chunk_bytes
                row[engine] = {"store_gbps": total / statistics.median(st) / 1e9,
                               "load_gbps": total / statistics.median(ld) / 1e9}
            eng.shutdown()
            out.append(row)
        finally:
            gpu.unregister_segment(store)
            store.close()
            drop_cache(name)
    return out


def segment_figures(gib: int) -> dict:
    """A segment of up to `gib` GiB (a third of /dev/shm's free space at
    most): its creation and cudaHostRegister of its arena, per GiB."""
    import shutil

    from shmkv import Store
    from shmkv.bench.segment_bench import measure
    from shmkv.transfer import gpu

    size = min(gib * GiB, shutil.disk_usage("/dev/shm").free // 3 // GiB * GiB)
    seg = measure(size, repeats=1)
    name = f"shmkv-bench-gpu-reg-{uuid.uuid4().hex[:8]}"
    store = Store.create(name, size)
    try:
        store.wait_reserved(timeout_s=600)
        t0 = time.perf_counter()
        gpu.register_segment(store, wait=True)
        reg = time.perf_counter() - t0
        gpu.unregister_segment(store)
    finally:
        store.close()
        drop_cache(name)
    return {"segment_bytes": size, "create_gbps": seg["create_gbps"], "ready_s": seg["ready_s"],
            "populate_write_gbps": seg["populate_write_gbps"], "register_s_per_gib": reg / (size / GiB)}


def report(r: dict) -> None:
    print(f"{r['device']}: {r['chunks']} chunks of {r['chunk_bytes'] / MiB:.0f} MiB, {r['layers']} layers")
    print(f"  store {r['store_gbps']:.1f} GB/s ({r['store_gbps_over_d2h']:.2f}x pinned D2H {r['d2h_gbps']:.1f}), "
          f"load {r['load_gbps']:.1f} GB/s ({r['load_gbps_over_h2d']:.2f}x pinned H2D {r['h2d_gbps']:.1f})")
    print(f"  load of 16 chunks {r['load_ms']:.1f} ms, first layer ready at {r['first_layer_ready_ms']:.2f} ms "
          f"(target <= {r['first_layer_target_ms']:.2f})")
    print(f"  compute {r['compute_alone_ms']:.1f} ms alone, {r['compute_with_stores_ms']:.1f} ms with the stores "
          f"(slowdown {r['overlap_slowdown']:.3f})")
    for name, e in r["engines"].items():
        print(f"  engine {name:6s}: store {e['store_gbps']:.1f} GB/s (slowdown {e['overlap_slowdown']:.3f}), load "
              f"{e['load_gbps']:.1f} GB/s ({e['load_ms']:.1f} ms, first layer {e['first_layer_ready_ms']:.2f} ms)")
    for c in r.get("layout_cases", []):
        print(f"  {c['case']:20s} auto: store {c['auto_store']}, load {c['auto_load']}; dma store "
              f"{c['dma']['store_gbps']:.1f} / load {c['dma']['load_gbps']:.1f} GB/s, kernel store "
              f"{c['kernel']['store_gbps']:.1f} / load {c['kernel']['load_gbps']:.1f} GB/s")
    print(f"  segment of {r['segment_bytes'] / GiB:.0f} GiB: ready in {r['ready_s']:.2f} s, reserved at "
          f"{r['create_gbps']:.2f} GB/s (MADV_POPULATE_WRITE {r['populate_write_gbps']}), cudaHostRegister "
          f"{r['register_s_per_gib']:.3f} s/GiB")
