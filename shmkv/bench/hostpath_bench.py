"""Host time of the transfer engine's per-step calls, copies excluded.

On a GPU the host issues a step's copies and goes on; what it spends in
`submit_load` (leases, copy plans, per-layer issue) and `submit_store`
(reservations, gathers' issue) is time the forward's launch waits for, and
the copy-engine choice runs there too. Measured here with deferred CPU
streams (a copy runs only when something waits for it, as on a device that
has not got to it yet) on a Llama-3-8B-shaped TP rank in vLLM's CUDA layout
(32 layers, 8 KV heads of 128, bfloat16, 16-token blocks, 256-token chunks)
over host tensors: an 8k-token hit (32 chunks; 2 GiB of cache and segment) loaded, a prefill step's 8
chunks stored, each on a fragmented block table. submit_load issues the
first load_issue_ahead layers' copies and returns; the rest are issued by
the forward's per-layer hooks (their host time, per layer, is measured as
`issue_per_layer_us`); `submit_load_every_layer_us` is submit_load issuing
every layer before it returns (what it did before). And the copy-engine
choice's walk of one 256-token unit, over the first layer (what the choice
reads now) and over every layer (what it walked before). The wait for a
step's load copies (`_settle_loading`) is device time and not measured here.
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
from shmkv.transfer import GroupWindow, LoadItem, StoreItem, TransferEngine
from shmkv.transfer.engine import LOAD_ISSUE_AHEAD
from shmkv.transfer.layout import KVLayout
from shmkv.transfer.streams import CpuBackend

MiB = 1 << 20
LAYERS, HEADS, HEAD, BS, CHUNK = 32, 8, 128, 16, 256


def _cache(blocks: int) -> list[torch.Tensor]:
    """Per layer [blocks, heads, block tokens, 2*head] (vLLM 0.32's HND view), zeros."""
    return [torch.zeros(blocks, HEADS, BS, 2 * HEAD, dtype=torch.bfloat16) for _ in range(LAYERS)]


def _median_us(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e6, 1)


def measure(hit_tokens: int, store_chunks: int, repeats: int) -> dict:
    per_chunk = CHUNK // BS
    blocks = hit_tokens // BS + store_chunks * per_chunk + 8
    layout = KVLayout("hnd", _cache(blocks), [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)],
                      block_size=BS)
    nbytes = layout.payload_bytes(CHUNK)
    chunks = hit_tokens // CHUNK
    name = f"shmkv-bench-{uuid.uuid4().hex[:8]}"
    store = Store.create(name, (chunks + store_chunks + 2) * nbytes + 64 * MiB, max_payload_bytes=nbytes)
    # NOTE: a put goes only where the arena is reserved: before the background reservation has
    # ended it would evict the hit's first chunks, and submit_load would time a lookup of a miss
    store.wait_reserved()
    rng = np.random.default_rng(0)
    try:
        keys = [i.to_bytes(16, "little") for i in range(1, chunks + 1)]
        for k in keys:
            store.put(k, bytes(nbytes), tokens=CHUNK)
        if store.stats()["ready_entries"] != chunks:
            raise RuntimeError(f"{store.stats()['ready_entries']} of the hit's {chunks} chunks are in the segment")
        loads, loads_all, rest, stores, choice_one, choice_all = [], [], [], [], [], []
        for rep in range(repeats):
            eng = TransferEngine(store, layout, 0, backend=CpuBackend(deferred=True))
            table = rng.permutation(np.arange(1, blocks))  # a long-running server's free list
            def window(i: int, table=table) -> tuple[GroupWindow]:  # the i-th chunk's blocks of the table
                return (GroupWindow(0, per_chunk, tuple(int(b) for b in table[i * per_chunk:(i + 1) * per_chunk])),)

            items = [LoadItem("hit", (k,), window(i)) for i, k in enumerate(keys)]
            t0 = time.perf_counter()
            job = eng.submit_load(items)
            loads.append(time.perf_counter() - t0)
            if len(job.jobs) != chunks:
                raise RuntimeError(f"{len(job.jobs)} of the hit's {chunks} chunks were leased: the timing would "
                                   "not be of a load")
            issued = len(job.events)
            t0 = time.perf_counter()
            job.issue_all()  # what the hooks of the layers after them issue, a layer at a time
            rest.append((time.perf_counter() - t0) / max(1, LAYERS - issued))
            sitems = [StoreItem("p", ((10_000 + rep * 100 + i).to_bytes(16, "little"),), CHUNK, window(chunks + i))
                      for i in range(store_chunks)]
            t0 = time.perf_counter()
            eng.submit_store(sitems)
            stores.append(time.perf_counter() - t0)
            if len(eng.pending_stores()) != store_chunks:
                raise RuntimeError(f"{len(eng.pending_stores())} of the step's {store_chunks} chunks were reserved")
            job.synchronize()  # the copies run; shutdown gives the leases back
            eng.shutdown()
            for it in sitems:  # room for the next round's: the hit stays whole
                store.delete(it.keys[0])
            every = TransferEngine(store, layout, 0, backend=CpuBackend(deferred=True), load_issue_ahead=LAYERS)
            t0 = time.perf_counter()
            job = every.submit_load(items)
            loads_all.append(time.perf_counter() - t0)
            if len(job.jobs) != chunks:
                raise RuntimeError(f"{len(job.jobs)} of the hit's {chunks} chunks were leased")
            job.synchronize()
            every.shutdown()
            slots = layout.slots_for_blocks(np.array(table[:per_chunk]), CHUNK)
            c = layout.copier._c
            t0 = time.perf_counter()
            c.token_copy_runs(slots, 0, 1)
            choice_one.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            c.token_copy_runs(slots, 0, -1)
            choice_all.append(time.perf_counter() - t0)
        return {"submit_load_us": _median_us(loads), "submit_load_us_per_chunk": round(_median_us(loads) / chunks, 2),
                "submit_load_every_layer_us": _median_us(loads_all), "issue_per_layer_us": _median_us(rest),
                "load_issue_ahead": LOAD_ISSUE_AHEAD,
                "submit_store_us": _median_us(stores),
                "submit_store_us_per_chunk": round(_median_us(stores) / store_chunks, 2),
                "choice_walk_first_layer_us_per_unit": _median_us(choice_one),
                "choice_walk_every_layer_us_per_unit": _median_us(choice_all)}
    finally:
        store.close()
        drop_cache(name)


def run(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="shmkv bench hostpath", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hit-tokens", type=int, default=8192, help="tokens of the loaded hit (whole chunks)")
    ap.add_argument("--store-chunks", type=int, default=8, help="chunks stored in the step")
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args(argv)
    return {"bench": "hostpath", "shape": {"layers": LAYERS, "kv_heads": HEADS, "head": HEAD, "block": BS,
                                           "chunk": CHUNK, "dtype": "bfloat16", "layout": "hnd"},
            "hit_tokens": a.hit_tokens, "store_chunks": a.store_chunks,
            **measure(a.hit_tokens, a.store_chunks, a.repeats)}


def report(r: dict) -> None:
    print(f"hit of {r['hit_tokens']} tokens: submit_load {r['submit_load_us']} us "
          f"({r['submit_load_us_per_chunk']} per chunk; {r['load_issue_ahead']} layers issued, then "
          f"{r['issue_per_layer_us']} us per layer in the hooks; every layer at once: "
          f"{r['submit_load_every_layer_us']} us); {r['store_chunks']} chunks stored: submit_store "
          f"{r['submit_store_us']} us ({r['submit_store_us_per_chunk']} per chunk); copy-engine choice per unit: "
          f"{r['choice_walk_first_layer_us_per_unit']} us (first layer) vs {r['choice_walk_every_layer_us_per_unit']} "
          "us (every layer)")
