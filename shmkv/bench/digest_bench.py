"""What the weights' identity costs at engine start (#63): the digest of a
rank's tensors as loaded (shmkv.integration.vllm.loaded_weights), in GB/s on
this host's CPU (xxh3-128 in threads; and the device hash, which a GPU's
tensors are hashed with where they lie, run here on the CPU with torch's
threads) and on a GPU when one is present, per thread count, repeated, and
what that makes of
an 8B model (16.1 GB of bf16 weights, TP = 1) and of a 70B model's shard at
TP = 8 (17.6 GB).

The tensors are random bf16, `--gib` in all, in tensors of `--tensor-mib`
(a Llama layer's projections are 32-448 MiB at 8B-70B). Each figure is the
median of `--repeats` runs with the spread (min-max); the order of the
thread counts is rotated between repeats.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch

from shmkv.integration.vllm.loaded_weights import digest_tensors

SHARDS_GB = {"8B (TP=1)": 16.06, "70B shard (TP=8)": 17.64}


def _tensors(gib: float, tensor_mib: int, device: str) -> list[tuple[str, torch.Tensor]]:
    n = max(1, int(gib * 1024 / tensor_mib))
    elems = tensor_mib << 19  # bf16: 2 bytes each
    g = torch.Generator(device="cpu").manual_seed(0)
    return [(f"layer.{i}.weight", torch.randn(elems, generator=g, dtype=torch.float32).to(torch.bfloat16).to(device))
            for i in range(n)]


def run(argv: list[str]) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="shmkv bench weights-digest", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=2.0, help="GiB of tensors digested per run (default 2)")
    ap.add_argument("--tensor-mib", type=int, default=64)
    ap.add_argument("--threads", default="", help="thread counts, comma-separated (default: 1 and this host's CPUs)")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args(argv)
    cpus = len(os.sched_getaffinity(0))
    threads = [int(x) for x in a.threads.split(",") if x] or sorted({1, min(cpus, 8)})
    runs = [("cpu", "xxh3"), ("cpu", "device")] + ([("cuda", "device")] if torch.cuda.is_available() else [])
    out: dict[str, Any] = {"cpus": cpus, "gib": a.gib, "tensor_mib": a.tensor_mib, "repeats": a.repeats, "rows": []}
    torch_threads = torch.get_num_threads()
    named: list = []
    for device, kernel in runs:
        if not named or named[0][1].device.type != device:
            named = _tensors(a.gib, a.tensor_mib, device)
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        mode = "auto" if kernel == "xxh3" else "device"
        digest_tensors(named[:1], "loaded", kernel=mode)  # warm: pages touched, threads started once
        times: dict[int, list[float]] = {n: [] for n in threads}
        digests = set()
        for r in range(a.repeats):
            order = threads[r % len(threads):] + threads[:r % len(threads)]
            for n in order:
                torch.set_num_threads(n)  # the device hash on the CPU: torch's threads
                if device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                digests.add(digest_tensors(named, "loaded", threads=n, kernel=mode).digest)
                times[n].append(time.perf_counter() - t0)
        torch.set_num_threads(torch_threads)
        if len(digests) != 1:
            raise RuntimeError(f"the digest of the same tensors differed between runs: {digests}")
        for n in threads:
            rates = [nbytes / 1e9 / s for s in times[n]]
            gbps = statistics.median(rates)
            out["rows"].append({"device": device, "kernel": kernel, "threads": n, "gb_per_s": round(gbps, 2),
                                "gb_per_s_min": round(min(rates), 2), "gb_per_s_max": round(max(rates), 2),
                                **{f"seconds_{k}": round(gb / gbps, 2) for k, gb in SHARDS_GB.items()}})
    return out


def report(r: dict[str, Any]) -> None:
    print(f"weights digest (xxh3-128 over every byte, {r['gib']} GiB in {r['tensor_mib']} MiB tensors, "
          f"median of {r['repeats']}, {r['cpus']} CPUs)")
    keys = list(SHARDS_GB)
    print(f"  {'device':6s} {'kernel':6s} {'threads':>7s} {'GB/s':>7s} {'min-max':>13s} "
          + " ".join(f"{k:>18s}" for k in keys))
    for row in r["rows"]:
        spread = f"{row['gb_per_s_min']}-{row['gb_per_s_max']}"
        print(f"  {row['device']:6s} {row.get('kernel', 'xxh3'):6s} {row['threads']:7d} {row['gb_per_s']:7.2f} "
              f"{spread:>13s} "
              + " ".join(f"{row['seconds_' + k]:17.2f}s" for k in keys))
