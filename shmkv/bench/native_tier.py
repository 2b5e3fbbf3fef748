"""vLLM's native offloading with a shared tier: one engine's scheduler side
(vLLM's own TieringOffloadingManager, built from a plain OffloadingConfig: no
model, no engine) per process, and `shmkv bench native-tier`.

Child process (used by the benchmark and tests/integration/vllm/serving/test_native_tier.py):

    python -m shmkv.bench.native_tier ROLE JSON

ROLE "store": chunk i's bytes (derived from its key) are written into this
engine's primary view at the ids prepare_store returns (as vLLM's worker
would; not timed), then complete_store and scheduler steps until no work is
pending (the cascade, timed); with "endless", fresh keys round after round
until killed (or the deadline). ROLE "load": every key is looked up, again each
step, until each is HIT or MISS (the promotion, timed), then the hits
prepared for loading and their bytes in this engine's primary view compared
with what "store" wrote. Prints one "RESULT {json}" line.

The benchmark: the same 64 MiB (256 chunks of 256 KiB) cascaded by engine A
and promoted by engine B, through the shmkv tier and through vLLM's own `fs`
tier on tmpfs and on disk (page cache warm), in one run; GB/s and seconds,
median over --repeats rounds of fresh keys, the tiers' order rotated each
round. Engine B's primary region (vLLM's memory, which every tier copies
into) is fresh in the `cold` case: the first touch of each of its pages is a
page fault inside the timed promotion, the same for every tier; in the `warm`
case B touched it all before timing, as an engine that has served a while.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import sys
import time

import numpy as np

from shmkv.bench import drop_cache

BYTES_PER_BLOCK = 16 << 10  # one worker's KV of one 16-token block
BLOCKS_PER_CHUNK = 16  # 256 KiB chunks


def offloading_config(p: dict):
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    tier = dict(p["raw_tier"]) if "raw_tier" in p else {"type": "shmkv", "cache_name": p["cache"], **p.get("tier", {})}
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=p.get("block", 16), layer_names=("l0", "l1"), group_id=0),),
        worker_kv_bytes_per_block=BYTES_PER_BLOCK, enable_kv_cache_events=p.get("events", False),
        extra_config={"cpu_bytes_to_use": p.get("cpu_bytes", 64 << 20), "secondary_tiers": [tier]},
        engine_id=f"{p['engine']}-{os.getpid()}",  # vLLM keeps a /dev/shm file per engine id: never join a stale one
        model=OffloadingModelConfig(name=p.get("model", "tiny"), dtype=p.get("dtype", "bfloat16")),
        cache=OffloadingCacheConfig(tokens_per_hash=p.get("block", 16), blocks_per_chunk=BLOCKS_PER_CHUNK),
        parallel=OffloadingParallelConfig(rank=0, world_size=p.get("world", 1), tp_size=p.get("world", 1),
                                          pp_size=1, pcp_size=1, dcp_size=1, data_parallel_index=0,
                                          data_parallel_size=1, data_parallel_rank_local=None,
                                          is_parallelism_agnostic=False))


def chunk_bytes_of(key: bytes, n: int) -> np.ndarray:
    return np.frombuffer((key * (n // len(key) + 1))[:n], dtype=np.uint8)


def main() -> None:
    role, p = sys.argv[1], json.loads(sys.argv[2])
    from vllm.plugins import load_general_plugins
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    load_general_plugins()  # the shmkv plugin registers {"type": "shmkv"}, as in every vLLM process
    cfg = offloading_config(p)
    spec = TieringOffloadingSpec(cfg)
    m = spec.get_manager()
    # NOTE: vLLM unlinks its region's file once every worker mapped it (a barrier); this process is
    # the only one to map it: unlinked now, a kill leaves nothing in /dev/shm
    with contextlib.suppress(FileNotFoundError):
        os.unlink(f"/dev/shm/vllm_offload_{cfg.engine_id}.mmap")
    view = np.asarray(m.primary_tier.get_kv_memoryview()).reshape(-1).view(np.uint8)
    n = view.size // spec.num_chunks
    ctx = ReqContext(req_id=f"{role}-req")

    def keys_of(round_: int) -> list:
        """The prompt's chunk keys (round 0; later rounds: fresh keys, as new prompts)."""
        ks = [make_offload_key(bytes([p.get("seed", 1), i % 256, i // 256, round_ % 256]) * 7 + b"hhhh", 0)
              for i in range(p["chunks"])]
        for i, k in enumerate(ks):
            ctx.set_offload_key_position(k, (round_ * p["chunks"] + i + 1) * BLOCKS_PER_CHUNK * 16)
        return ks

    keys = keys_of(0)
    m.on_new_request(ctx)
    for tier in m.secondary_tiers:  # a running engine's segment is reserved and mapped long before requests
        if hasattr(tier, "store"):
            tier.store.wait_reserved(p.get("timeout", 120), mapped=True)
    out: dict = {"chunk_bytes": int(n)}
    if p.get("warm_primary"):
        # an engine that has served a while has touched its whole primary region: no first-touch page faults
        # of vLLM's own memory in what is timed (both tiers copy into it alike)
        view[:] = 0
    t0 = time.perf_counter()
    deadline = time.monotonic() + p.get("timeout", 120)

    def step() -> None:
        m.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
        time.sleep(p.get("step_s", 0.001))  # an engine step: the scheduler waits for its workers

    if role == "store":
        stored, worker_s = 0, 0.0
        # "endless": fresh keys round after round until killed or the deadline (a store always under way)
        batches = ((r, i) for r in (itertools.count() if p.get("endless") else [0]) for i in range(0, len(keys), 16))
        for r, i in batches:
            if i == 0 and r:
                keys = keys_of(r)
                if time.monotonic() > deadline:
                    break
            batch = keys[i:i + 16]
            prep = m.prepare_store(batch, ctx)
            while prep is None and time.monotonic() < deadline:  # the primary tier is full of chunks still
                step()  # cascading (a slow host): give the cascade steps, as a busy engine would
                prep = m.prepare_store(batch, ctx)
            assert prep is not None, "the primary tier refused the store until the deadline"
            ids = np.asarray(prep.store_spec.chunk_ids)  # vLLM's CPU load/store spec
            tw = time.perf_counter()  # vLLM's worker writes the primary view: not part of the cascade
            for k, cid in zip(prep.keys_to_store, ids):
                view[int(cid) * n:(int(cid) + 1) * n] = chunk_bytes_of(k, n)
            worker_s += time.perf_counter() - tw
            m.complete_store(batch, ctx)
            stored += len(prep.keys_to_store)
            step()
        m.on_request_finished(ctx)
        while m.has_pending_work() and time.monotonic() < deadline:
            step()
        out.update(stored=stored, pending=m.has_pending_work(), seconds=time.perf_counter() - t0 - worker_s)
    else:
        # as vLLM's scheduler asks: every key of the prompt, again each step, until none is pending
        results = [m.lookup(k, ctx) for k in keys]
        steps = 0
        while any(r not in (LookupResult.HIT, LookupResult.MISS) for r in results) and time.monotonic() < deadline:
            step()
            steps += 1
            results = [r if r in (LookupResult.HIT, LookupResult.MISS) else m.lookup(k, ctx)
                       for k, r in zip(keys, results)]
        promoted_s = time.perf_counter() - t0  # every chunk HIT in the primary tier (or MISS): the promotion
        results = [r.name for r in results]
        first_miss = next((i for i, r in enumerate(results) if r != "HIT"), len(results))
        hits = keys[:first_miss]
        equal = True
        if hits:
            spec_ = m.prepare_load(hits, ctx)
            for k, cid in zip(hits, np.asarray(spec_.chunk_ids)):
                equal &= bool(np.array_equal(view[int(cid) * n:(int(cid) + 1) * n], chunk_bytes_of(k, n)))
            m.complete_load(hits, ctx)
        m.on_request_finished(ctx)
        step()
        out.update(hits=len(hits), results=sorted(set(results)), equal=equal, seconds=promoted_s,
                   steps=steps)
    del view  # vLLM unmaps the primary region at shutdown: no export of it may remain
    m.shutdown()
    print("RESULT " + json.dumps(out))


def child(role: str, params: dict, timeout: float = 300) -> dict:
    """Run one engine's side in a child process; its RESULT."""
    import subprocess

    r = subprocess.run([sys.executable, "-m", "shmkv.bench.native_tier", role, json.dumps(params)],
                       capture_output=True, text=True, timeout=timeout, env=dict(os.environ))
    if r.returncode != 0:
        raise RuntimeError(f"native-tier {role} child failed: {r.stderr[-2000:]}")
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def run(argv: list[str]) -> dict:
    import argparse
    import shutil
    import statistics
    import tempfile
    import uuid

    ap = argparse.ArgumentParser(prog="shmkv bench native-tier", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=256, help="chunks of 256 KiB moved per round")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--disk-dir", default=os.path.join(tempfile.gettempdir(), "shmkv-bench-native-fs"),
                    help="where vLLM's fs tier writes for the on-disk case")
    ap.add_argument("--step-ms", type=float, default=1.0,
                    help="the engine step between the scheduler's passes (default 1 ms: the scheduler's own cost "
                         "shows; an engine's forward takes tens of ms, and then what counts is how many steps a "
                         "promotion takes, reported as steps)")
    ap.add_argument("--primary", choices=("cold", "warm", "both"), default="both",
                    help="engine B's primary region fresh (its first touch timed, as a new engine's) or touched "
                         "before timing (an engine that has served a while), or both (default)")
    a = ap.parse_args(argv)
    cache = f"shmkv-bench-native-{uuid.uuid4().hex[:8]}"
    tmpfs = f"/dev/shm/shmkv-bench-native-fs-{uuid.uuid4().hex[:8]}"
    cases = {"shmkv": {"cache": cache}, "fs_tmpfs": {"raw_tier": {"type": "fs", "root_dir": tmpfs}},
             "fs_disk": {"raw_tier": {"type": "fs", "root_dir": a.disk_dir}}}
    primaries = ("cold", "warm") if a.primary == "both" else (a.primary,)
    out: dict = {"chunks": a.chunks, "repeats": a.repeats, "primaries": list(primaries), "step_ms": a.step_ms}
    samples: dict = {name: {"cascade": [], **{f"promote_{w}": [] for w in primaries},
                            **{f"steps_{w}": [] for w in primaries}} for name in cases}
    nbytes = 0
    try:
        for r in range(a.repeats):
            names = list(cases)
            for name in names[r % len(names):] + names[:r % len(names)]:  # each tier first in turn
                for w in primaries:
                    p = dict(cases[name], chunks=a.chunks, seed=1 + r * len(primaries) + primaries.index(w),
                             step_s=a.step_ms / 1e3)
                    st = child("store", dict(p, engine="A"))
                    ld = child("load", dict(p, engine="B", warm_primary=w == "warm"))
                    if ld["hits"] != a.chunks or not ld["equal"]:
                        raise RuntimeError(f"{name}: B found {ld['hits']} of {a.chunks} chunks (equal {ld['equal']})")
                    nbytes = a.chunks * st["chunk_bytes"]
                    samples[name]["cascade"].append(st["seconds"])
                    samples[name][f"promote_{w}"].append(ld["seconds"])
                    samples[name][f"steps_{w}"].append(ld["steps"])
        med = statistics.median
        for name, got in samples.items():
            out[name] = {"cascade_s": med(got["cascade"]), "cascade_gbps": nbytes / med(got["cascade"]) / 1e9,
                         "samples": got}
            for w in primaries:
                out[name][f"promote_{w}_s"] = med(got[f"promote_{w}"])
                out[name][f"promote_{w}_gbps"] = nbytes / med(got[f"promote_{w}"]) / 1e9
                out[name][f"promote_{w}_steps"] = med(got[f"steps_{w}"])
        out["bytes"] = nbytes
        for w in primaries:
            out[f"promote_{w}_over_fs_tmpfs"] = out["shmkv"][f"promote_{w}_s"] / out["fs_tmpfs"][f"promote_{w}_s"]
    finally:
        drop_cache(cache)
        shutil.rmtree(tmpfs, ignore_errors=True)
        shutil.rmtree(a.disk_dir, ignore_errors=True)
    return out


def report(r: dict) -> None:
    print(f"{r['chunks']} chunks ({r['bytes'] / 2**20:.0f} MiB), engine A cascades, engine B promotes "
          f"(median of {r['repeats']}; B's primary region {' and '.join(r['primaries'])}; "
          f"{r['step_ms']:g} ms engine steps):")
    for name in ("shmkv", "fs_tmpfs", "fs_disk"):
        c = r[name]
        promote = ", ".join(f"promote {w} {c[f'promote_{w}_s'] * 1e3:6.1f} ms ({c[f'promote_{w}_gbps']:.2f} GB/s, "
                            f"{c[f'promote_{w}_steps']:g} steps)" for w in r["primaries"])
        print(f"  {name:9s} cascade {c['cascade_s'] * 1e3:7.1f} ms ({c['cascade_gbps']:.2f} GB/s), {promote}")
    for w in r["primaries"]:
        print(f"  shmkv promotion / fs on tmpfs, {w} primary: {r[f'promote_{w}_over_fs_tmpfs']:.2f}")


if __name__ == "__main__":
    main()
