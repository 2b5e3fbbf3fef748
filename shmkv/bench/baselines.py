"""memcpy baselines that move the same working set as the operation they are
compared with.

  warm  one destination buffer, copied into again and again (partly served
        from the CPU caches: flattering for small chunks)
  cold  `slots` rotating destinations in a /dev/shm mapping, as many as the
        store or kernel under test rotates through (what a chunk store sees)
  first_touch  (with first_touch=True) a destination in /dev/shm whose pages
        are allocated but not yet mapped in this process: each page's first
        write is a page fault, as a copy into a segment attached without
        populate pays

Benchmarks report them and compute their ratios against the cold one (a
copy into first-touched pages against first_touch).
"""

from __future__ import annotations

import mmap
import os
import statistics
import time
import uuid

import numpy as np


def median_gbps(fn, nbytes: int, repeats: int) -> float:
    """GB/s of moving `nbytes` with fn(), from the median of `repeats` runs."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def memcpy_baselines(nbytes: int, slots: int, repeats: int, first_touch: bool = False) -> dict[str, float]:
    """{"memcpy_warm_gbps", "memcpy_cold_gbps"} for copies of `nbytes`, and
    "memcpy_first_touch_gbps" with `first_touch`."""
    src = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8)
    warm = np.empty_like(src)
    warm[:] = src
    warm_gbps = median_gbps(lambda: np.copyto(warm, src), nbytes, repeats)
    path = f"/dev/shm/shmkv-bench-memcpy-{uuid.uuid4().hex[:8]}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes * slots)
        with mmap.mmap(fd, nbytes * slots) as m:
            region = np.frombuffer(m, dtype=np.uint8)
            region[:] = 0  # fault every page in first, as the store's populate does
            views = [region[i * nbytes:(i + 1) * nbytes] for i in range(slots)]
            it = iter(range(1 << 30))
            cold_gbps = median_gbps(lambda: np.copyto(views[next(it) % slots], src), nbytes,
                                     max(repeats, 2 * slots))
            views.clear()  # the mapping closes only once no array exports it
            del region
    finally:
        os.close(fd)
        os.unlink(path)
    out = {"memcpy_warm_gbps": warm_gbps, "memcpy_cold_gbps": cold_gbps}
    if first_touch:
        out["memcpy_first_touch_gbps"] = _first_touch_gbps(src, repeats)
    return out


def _first_touch_gbps(src: np.ndarray, repeats: int) -> float:
    """memcpy of `src` into /dev/shm pages allocated (fallocate) but not yet
    mapped in this process, a fresh file each time; the median GB/s."""
    nbytes, times = src.nbytes, []
    for _ in range(repeats):
        path = f"/dev/shm/shmkv-bench-memcpy-{uuid.uuid4().hex[:8]}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)
            with mmap.mmap(fd, nbytes) as m:
                dst = np.frombuffer(m, dtype=np.uint8)
                t0 = time.perf_counter()
                np.copyto(dst, src)
                times.append(time.perf_counter() - t0)
                del dst
        finally:
            os.close(fd)
            os.unlink(path)
    return nbytes / statistics.median(times) / 1e9
