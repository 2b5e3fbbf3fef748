"""What huge pages change for a segment: the same measurements in segment
directories of each kind (`--dirs A,B`: for example a tmpfs mounted
huge=within_size and one mounted huge=never; each is used as
SHMKV_SEGMENT_DIR in turn), in one run.

  pages              what shmkv.hostmem says the directory gives
  pmd_mapped_share   of a populated segment's mapped bytes, the share mapped by huge pages (smaps)
  create_s, ready_s, reserved_s   segment creation (bench segment's measurement)
  put_gbps, get_gbps               a 32 MiB chunk in and out (bench store's), with memcpy_gbps beside
  gather_gbps, scatter_gbps        paged KV <-> segment (bench kernels' CPU case, a smaller model)
  mlock_s_per_gib    pinning the populated segment's pages in memory (mlock), the CPU side of
                     what cudaHostRegister does per GiB

    shmkv bench pages --dirs /mnt/shmkv-huge,/mnt/shmkv-small --json
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import time
import uuid

from shmkv import Store
from shmkv.bench import drop_cache
from shmkv.bench.kernels_bench import bench_cpu
from shmkv.bench.segment_bench import shmkv_create
from shmkv.bench.store_bench import bench_size
from shmkv.hostmem import segment_pages
from shmkv.names import SEGMENT_DIR_ENV

GiB, MiB = 1 << 30, 1 << 20


def _pmd_share(path: str) -> float:
    """Of this process's mapping of `path`, the share of its resident bytes mapped by huge pages."""
    rss = pmd = 0
    here = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0] if line.strip() else ""
            if not head.endswith(":") or "-" in head:
                here = line.rstrip().endswith(path)
            elif here and head == "Rss:":
                rss += int(line.split()[1])
            elif here and head in ("ShmemPmdMapped:", "FilePmdMapped:"):
                pmd += int(line.split()[1])
    return round(pmd / rss, 3) if rss else 0.0


def _populated_segment(directory: str, size: int) -> dict[str, float]:
    """Populate a segment, then pin its file's pages with mlock: (share on huge pages, mlock s/GiB)."""
    name = f"shmkv-bench-pages-{uuid.uuid4().hex[:8]}"
    store = Store.create(name, size, populate=True)
    try:
        assert store.wait_reserved(timeout_s=600)
        path = os.path.join(directory, name)
        fd = os.open(path, os.O_RDWR)
        try:
            m = mmap.mmap(fd, size)
            m.madvise(getattr(mmap, "MADV_POPULATE_WRITE", 23))
            share = _pmd_share(path)
            libc = ctypes.CDLL(None, use_errno=True)
            addr = ctypes.c_void_p.from_buffer(m)  # a pointer into the mapping
            t0 = time.perf_counter()
            rc = libc.mlock(ctypes.c_void_p(ctypes.addressof(addr)), ctypes.c_size_t(size))
            mlock_s = time.perf_counter() - t0
            libc.munlock(ctypes.c_void_p(ctypes.addressof(addr)), ctypes.c_size_t(size))
            del addr
            m.close()
        finally:
            os.close(fd)
        return {"pmd_mapped_share": share, "mlock_s_per_gib": round(mlock_s / (size / GiB), 4) if rc == 0 else None}
    finally:
        store.close()
        drop_cache(name)


def measure(directory: str, size: int, repeats: int) -> dict:
    before = os.environ.get(SEGMENT_DIR_ENV)
    os.environ[SEGMENT_DIR_ENV] = directory
    try:
        pages = segment_pages(directory)
        out = {"dir": directory, "pages": "huge" if pages.huge else "4 KiB", "how": pages.how}
        out.update(_populated_segment(directory, size))
        out.update({k: round(v, 4) for k, v in shmkv_create(size).items()})
        store = bench_size(32 * MiB, 6, repeats)
        out.update({k: round(store[k], 2) for k in ("put_gbps", "get_gbps", "memcpy_gbps")})
        kern = bench_cpu(layers=8, heads=8, head=128, bs=128, chunk=256, blocks=64, repeats=repeats, kinds=("cpu",),
                         cold=False)
        out.update({k: round(kern[k], 2) for k in ("gather_gbps", "scatter_gbps")})
        return out
    finally:
        if before is None:
            os.environ.pop(SEGMENT_DIR_ENV, None)
        else:
            os.environ[SEGMENT_DIR_ENV] = before


def run(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="shmkv bench pages", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dirs", required=True, help="segment directories to compare (comma-separated): each a "
                    "tmpfs of this uid, mode 0700")
    ap.add_argument("--size", type=int, default=1024, help="segment size in MiB")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args(argv)
    return {"bench": "pages", "size_bytes": a.size * MiB,
            "dirs": [measure(d, a.size * MiB, a.repeats) for d in a.dirs.split(",") if d]}


def report(r: dict) -> None:
    for d in r["dirs"]:
        print(f"{d['dir']}: {d['pages']} pages ({d['how']}); huge-mapped share {d['pmd_mapped_share']}; create "
              f"{d['create_s']} s, reserved {d['reserved_s']} s; put {d['put_gbps']} / get {d['get_gbps']} GB/s "
              f"(memcpy {d['memcpy_gbps']}); gather {d['gather_gbps']} / scatter {d['scatter_gbps']} GB/s; "
              f"mlock {d['mlock_s_per_gib']} s/GiB")
