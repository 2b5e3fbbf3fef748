"""memcpy baselines that move the same working set as the operation they are
compared with.

  warm  one destination buffer, copied into again and again (partly served
        from the CPU caches: flattering for small chunks)
  cold  `slots` rotating destinations in a /dev/shm mapping, as many as the
        store or kernel under test rotates through (what a chunk store sees)

Benchmarks report both and compute their ratios against the cold one.
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


def memcpy_baselines(nbytes: int, slots: int, repeats: int) -> dict[str, float]:
    """{"memcpy_warm_gbps", "memcpy_cold_gbps"} for copies of `nbytes`."""
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
    return {"memcpy_warm_gbps": warm_gbps, "memcpy_cold_gbps": cold_gbps}
