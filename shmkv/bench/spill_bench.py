"""What RAM evicts reaches the disk: a writer commits chunks into a small
shared tier at a given pace while the maintainer (its default passes, a
thread of this process, `io_threads` spilling) writes them to the disk tier.
Per pace: chunks committed, refused (FULL: put_spill_behind under the spill
guard), then found in memory, found on disk, and lost (committed, in
neither). `--spill-guard off` keeps the maintainer from renewing the guard:
puts evict from the LRU tail whether spilled or not (shmkv before the guard).

    shmkv bench spill [--paces 0,300,100,50] [--json]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time
from typing import Any

import xxhash

from shmkv import PutResult, Store
from shmkv.bench import drop_cache
from shmkv.config import load_config
from shmkv.services import maintainer as maintainer_mod
from shmkv.services.maintainer import Maintainer
from shmkv.tiers import open_tiers

MiB = 1 << 20


def run_pace(pace_mbps: float, *, chunks: int, chunk_mib: int, capacity_mib: int, threads: int,
             guard: bool, workdir: str) -> dict[str, Any]:
    name = f"shmkv-bench-spill-{os.getpid()}"
    size = chunk_mib * MiB
    store = Store.create(name, capacity_mib * MiB, max_payload_bytes=size)
    disk_dir = os.path.join(workdir, "disk")
    shutil.rmtree(disk_dir, ignore_errors=True)
    cfg = load_config({"cache_name": name, "disk_dir": disk_dir, "disk_capacity": 1 << 40, "io_threads": threads},
                      env={})
    chain = open_tiers(cfg, store)
    m = Maintainer(chain, low_watermark=cfg.low_watermark, spill_ahead=cfg.spill_ahead, threads=threads)
    if not guard:
        m.store = _NoGuard(store)  # type: ignore[assignment]
    stop = threading.Event()

    def passes() -> None:
        while not stop.is_set():
            m.run_once()
            stop.wait(0.05)  # MaintainerRole's interval

    t = threading.Thread(target=passes, daemon=True)
    t.start()
    payload = os.urandom(size)
    committed, refused = [], 0
    t0 = time.perf_counter()
    try:
        for i in range(chunks):
            if pace_mbps > 0:
                due = t0 + (i * size) / (pace_mbps * 1e6)
                while (now := time.perf_counter()) < due:
                    time.sleep(due - now)
            k = xxhash.xxh3_128_digest(f"spill-{i}".encode())
            got = store.put(k, payload, namespace=b"n" * 16)
            if got is PutResult.OK:
                committed.append(k)
            elif got is PutResult.FULL:
                refused += 1
        write_s = time.perf_counter() - t0
        time.sleep(1.0)  # the maintainer's passes after the last put (nothing is asserted on it)
    finally:
        stop.set()
        t.join()
        m.close()
    in_mem = store.contains(committed)
    on_disk = chain.disk.contains(committed) if chain.disk is not None else [False] * len(committed)
    st = store.stats()
    out = {"pace_mbps": pace_mbps or "unpaced", "committed": len(committed), "refused": refused,
           "in_memory": sum(in_mem), "on_disk": sum(d and not m_ for d, m_ in zip(on_disk, in_mem)),
           "lost": sum(not (a or b) for a, b in zip(in_mem, on_disk)),
           "evicted_unspilled": st["evicted_unspilled"], "put_spill_behind": st.get("put_spill_behind", 0),
           "write_mbps": round(len(committed) * size / write_s / 1e6, 1),
           "spill_mbps": round(st["spill_bytes"] / write_s / 1e6, 1)}
    chain.close()
    store.close()
    drop_cache(name)
    return out


class _NoGuard:
    """The store as the maintainer sees it, less the spill guard (the comparison row)."""

    def __init__(self, store: Store) -> None:
        self._s = store

    def renew_spill_guard(self, seconds: float) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._s, name)


def run(argv: list[str]) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="shmkv bench spill", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--paces", default="0,300,100,50", help="writer paces in MB/s, 0: unpaced")
    ap.add_argument("--chunks", type=int, default=768)
    ap.add_argument("--chunk-mib", type=int, default=1)
    ap.add_argument("--capacity-mib", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2, help="io_threads of the maintainer")
    ap.add_argument("--spill-guard", choices=("on", "off"), default="on")
    ap.add_argument("--workdir", default=None, help="where the disk tier goes (default: a temporary directory)")
    a = ap.parse_args(argv)
    workdir = a.workdir or tempfile.mkdtemp(prefix="shmkv-bench-spill-")
    try:
        rows = [run_pace(float(p), chunks=a.chunks, chunk_mib=a.chunk_mib, capacity_mib=a.capacity_mib,
                         threads=a.threads, guard=a.spill_guard == "on", workdir=workdir)
                for p in a.paces.split(",")]
    finally:
        if a.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    return {"bench": "spill", "spill_guard": a.spill_guard, "chunks": a.chunks, "chunk_mib": a.chunk_mib,
            "capacity_mib": a.capacity_mib, "io_threads": a.threads,
            "guard_seconds": maintainer_mod.SPILL_GUARD_S, "rows": rows}


def report(result: dict[str, Any]) -> None:
    print(f"spill guard {result['spill_guard']}: {result['chunks']} x {result['chunk_mib']} MiB into "
          f"{result['capacity_mib']} MiB, {result['io_threads']} spill threads")
    print(f"{'pace MB/s':>10} {'committed':>9} {'refused':>7} {'in memory':>9} {'on disk':>7} {'lost':>5} "
          f"{'write MB/s':>10} {'spill MB/s':>10}")
    for r in result["rows"]:
        print(f"{r['pace_mbps']!s:>10} {r['committed']:>9} {r['refused']:>7} {r['in_memory']:>9} {r['on_disk']:>7} "
              f"{r['lost']:>5} {r['write_mbps']:>10} {r['spill_mbps']:>10}")
