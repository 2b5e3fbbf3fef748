"""Segment creation: how soon a new segment is usable, and how fast its
pages are reserved, against the kernel's own ways of populating the same
bytes of /dev/shm in the same run.

  create_s             Store.create returns (metadata and the first 256 MiB reserved)
  ready_s              from the start of create to the first put committed
  reserved_s           from the start of create to the whole arena reserved (background)
  create_gbps          capacity / reserved_s
  populate_write_gbps  MADV_POPULATE_WRITE of a fresh /dev/shm mapping of the same size
                       (what vLLM's own shared offload region does); None without it
  fallocate_gbps       posix_fallocate of a fresh /dev/shm file of the same size
  sync_create_s        fallocate + MAP_POPULATE of the whole file: creation as it
                       was before the background reservation
Each figure is the median of --repeats runs.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import time
import uuid

import numpy as np

from shmkv import PutResult, Store
from shmkv.bench import drop_cache

GiB = 1 << 30
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14


def _fresh_file(size: int):
    path = f"/dev/shm/shmkv-bench-seg-{uuid.uuid4().hex[:8]}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, size)
    return path, fd


def populate_write_s(size: int) -> float | None:
    path, fd = _fresh_file(size)
    try:
        with mmap.mmap(fd, size) as m:
            t0 = time.perf_counter()
            try:
                m.madvise(MADV_POPULATE_WRITE)
            except OSError:
                return None  # an older kernel
            return time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(path)


def fallocate_s(size: int, *, map_populate: bool = False) -> float:
    path, fd = _fresh_file(size)
    try:
        t0 = time.perf_counter()
        os.posix_fallocate(fd, 0, size)
        if map_populate:
            with mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE):
                pass
        return time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(path)


def shmkv_create(size: int) -> dict[str, float]:
    name = f"shmkv-bench-seg-{uuid.uuid4().hex[:8]}"
    payload = np.ones(1 << 20, dtype=np.uint8)
    t0 = time.perf_counter()
    store = Store.create(name, size)
    try:
        created = time.perf_counter() - t0
        assert store.put(b"\x01" * 16, payload) is PutResult.OK
        ready = time.perf_counter() - t0
        assert store.wait_reserved(timeout_s=600), "the arena was not reserved in full"
        reserved = time.perf_counter() - t0
        return {"create_s": created, "ready_s": ready, "reserved_s": reserved}
    finally:
        store.close()
        drop_cache(name)


def measure(size: int, repeats: int) -> dict:
    med = statistics.median
    runs = [shmkv_create(size) for _ in range(repeats)]
    pw = [populate_write_s(size) for _ in range(repeats)]
    fa = [fallocate_s(size) for _ in range(repeats)]
    sync = [fallocate_s(size, map_populate=True) for _ in range(repeats)]
    out = {k: med(r[k] for r in runs) for k in ("create_s", "ready_s", "reserved_s")}
    out.update({
        "capacity_bytes": size, "repeats": repeats,
        "create_gbps": size / out["reserved_s"] / 1e9,
        "populate_write_gbps": None if None in pw else size / med(pw) / 1e9,
        "fallocate_gbps": size / med(fa) / 1e9,
        "sync_create_s": med(sync),
    })
    if out["populate_write_gbps"]:
        out["create_over_populate_write"] = out["create_gbps"] / out["populate_write_gbps"]
    return out


def default_size() -> int:
    """8 GiB, or less where /dev/shm cannot hold two segments of it."""
    free = shutil.disk_usage("/dev/shm").free
    return max(GiB, min(8 * GiB, free // 3 // GiB * GiB))


def run(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="shmkv bench segment", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=int, default=0, help="segment size (default: 8, less if /dev/shm is small)")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    return measure(a.gib * GiB if a.gib else default_size(), a.repeats)


def report(r: dict) -> None:
    pw = r["populate_write_gbps"]
    print(f"segment of {r['capacity_bytes'] / GiB:.0f} GiB (median of {r['repeats']}): create returns in "
          f"{r['create_s'] * 1e3:.0f} ms, first put committed at {r['ready_s'] * 1e3:.0f} ms, whole arena reserved "
          f"at {r['reserved_s']:.2f} s ({r['create_gbps']:.2f} GB/s)")
    print(f"  same bytes: MADV_POPULATE_WRITE {'n/a' if pw is None else f'{pw:.2f} GB/s'}, posix_fallocate "
          f"{r['fallocate_gbps']:.2f} GB/s, fallocate + MAP_POPULATE (creation before) {r['sync_create_s']:.2f} s")
