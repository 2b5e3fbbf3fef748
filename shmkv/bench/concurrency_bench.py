"""`shmkv bench concurrency`: what shmkv costs on the two most
common paths, measured with vLLM's own client and its own datasets at
several `--max-concurrency` levels:

  random             no reuse at all (vLLM's `random` dataset): shmkv looks
                     up, misses and stores every chunk; the goal is token
                     throughput >= 0.98 of vLLM alone
  prefix_repetition  prefixes vLLM's own cache already holds (its
                     `prefix_repetition` dataset, asked once untimed first):
                     shmkv must load nothing; the goal is TTFT p50 within
                     2 % of vLLM alone

One vLLM-alone server and one shmkv server (a segment of its own) run side by
side on the same cores (vLLM's default binding) and are measured in turn,
the order alternated run by run; each (dataset, concurrency, run) has its own seed, so
no measurement sees another's prompts except where the dataset repeats them.
Counters check the controls (shmkv loads 0 tokens on both datasets).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

from shmkv.bench.serve_bench import COUNTERS, Run, Workload, server_counters, wait_stores
from shmkv.engines.vllm_server import NO_FORK_HELP, VllmServer

DATASETS = ("random", "prefix_repetition")
GOALS = {"random": ("total_tokens_per_s", 0.98, "at least"), "prefix_repetition": ("ttft_p50_ms", 1.02, "at most")}


def dataset_args(name: str, a: argparse.Namespace, seed: int) -> list[str]:
    if name == "random":
        return ["--dataset-name", "random", "--random-input-len", str(a.random_tokens),
                "--random-output-len", str(a.output_tokens), "--random-range-ratio", "0", "--seed", str(seed)]
    if name == "prefix_repetition":
        return ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(a.prefix_tokens),
                "--prefix-repetition-suffix-len", str(a.suffix_tokens),
                "--prefix-repetition-num-prefixes", str(a.prefixes),
                "--prefix-repetition-output-len", str(a.output_tokens), "--seed", str(seed)]
    raise ValueError(f"dataset {name!r}: expected one of {', '.join(DATASETS)}")


def measure(run: Run, server: VllmServer, name: str, a: argparse.Namespace, concurrency: int, seed: int,
            label: str) -> dict[str, Any]:
    requests = max(a.requests, concurrency)
    args = dataset_args(name, a, seed)
    result = os.path.join(run.data, f"{label}.result.json")
    client = run.client()
    if name == "prefix_repetition":  # the prefixes in vLLM's own cache first, untimed
        client.run_dataset(server.url, run.model, args, result, requests=requests, max_concurrency=concurrency)
        wait_stores([server])
    before = server_counters([server])
    r = client.run_dataset(server.url, run.model, args, result, requests=requests, max_concurrency=concurrency,
                           metrics="ttft,tpot,e2el", percentiles="50,90,99")
    wait_stores([server])
    after = server_counters([server])
    if r.get("completed") != requests:
        raise RuntimeError(f"{label}: vLLM's client completed {r.get('completed')} of {requests} requests; "
                           f"see {run.logs}")
    return {"requests": requests, "ttft_p50_ms": round(r["median_ttft_ms"], 2),
            "ttft_p99_ms": round(r["p99_ttft_ms"], 2),
            "tpot_p50_ms": round(r["median_tpot_ms"], 2), "total_tokens_per_s": round(r["total_token_throughput"], 2),
            **{k: int(after[k] - before[k]) for k in COUNTERS}}


def run(argv: list[str]) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="shmkv bench concurrency", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,4,16", help="the --max-concurrency levels, comma-separated")
    ap.add_argument("--datasets", default=",".join(DATASETS))
    ap.add_argument("--runs", type=int, default=2, help="measurements per variant and level, order alternated")
    ap.add_argument("--requests", type=int, default=16, help="requests per measurement (at least the level)")
    ap.add_argument("--random-tokens", type=int, default=256, help="random's prompts")
    ap.add_argument("--prefix-tokens", type=int, default=512, help="prefix_repetition's prefixes")
    ap.add_argument("--suffix-tokens", type=int, default=32)
    ap.add_argument("--prefixes", type=int, default=4, help="prefix_repetition's distinct prefixes")
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--capacity", default="1GiB", help="shmkv's segment")
    ap.add_argument("--small", action="store_true", help="the small test model")
    ap.add_argument("--no-fork", dest="fork", action="store_false",
                    help=NO_FORK_HELP)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default=None)
    a = ap.parse_args(argv)
    levels = [int(x) for x in a.concurrency.split(",") if x]
    names = [x for x in a.datasets.split(",") if x]
    for n in names:
        dataset_args(n, a, 0)  # an unknown dataset fails before any server starts
    a.workdir = a.workdir or tempfile.mkdtemp(prefix="shmkv-bench-concurrency-")
    longest = max(a.random_tokens, a.prefix_tokens + a.suffix_tokens) + a.output_tokens
    r = Run(a, Workload(prefix_tokens=a.prefix_tokens, suffix_tokens=a.suffix_tokens, output_tokens=a.output_tokens,
                        vllm_cache_prompts=max(64, 4 * max(levels))))
    r.max_model_len = max(r.max_model_len, -(-longest // 128) * 128 + 128)
    rows: dict[str, dict[str, Any]] = {}
    t0 = time.monotonic()
    try:
        # NOTE: both on vLLM's default binding: they compute on the same cores (measured in turn, never
        # together), so no variant gets the quieter core; started together (nothing is measured meanwhile)
        servers: list[VllmServer] = []
        try:
            servers = r.servers(["concurrency-vllm", "concurrency-shmkv"], [None, r.segment("concurrency")],
                                a.capacity, bind=False)
            variants = dict(zip(("vllm", "shmkv"), servers))
            r.warm_up(servers)
            seed = 1000 * a.seed
            for name in names:
                for level in levels:
                    got: dict[str, list[dict[str, Any]]] = {"vllm": [], "shmkv": []}
                    for k in range(a.runs):
                        seed += 1
                        for v in (("vllm", "shmkv") if k % 2 == 0 else ("shmkv", "vllm")):
                            sys.stderr.write(f"shmkv bench concurrency: {name} x{level} run {k + 1} {v} ...\n")
                            got[v].append(measure(r, variants[v], name, a, level, seed, f"{name}-{level}-{k}-{v}"))
                    rows[f"{name}@{level}"] = _summary(name, level, got)
        finally:
            for s in servers:
                s.close()
    finally:
        r.cleanup()
    failed = [f"{k}: shmkv loaded {v['shmkv']['shmkv_loaded_tokens']} tokens" for k, v in rows.items()
              if v["shmkv"]["shmkv_loaded_tokens"]]
    out = {"bench": "concurrency", "model": "small" if a.small else "timing", "runs": a.runs,
           "random_tokens": a.random_tokens, "prefix_tokens": a.prefix_tokens, "suffix_tokens": a.suffix_tokens,
           "output_tokens": a.output_tokens, "rows": rows,
           "seconds": round(time.monotonic() - t0, 1)}
    if failed:
        out["failed"] = "; ".join(failed)
    return out


def _summary(name: str, level: int, got: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per variant: the median over runs of each figure, the counters summed;
    shmkv over vLLM alone for throughput and TTFT, and the goal's verdict."""
    out: dict[str, Any] = {"dataset": name, "concurrency": level}
    for v, ms in got.items():
        out[v] = {k: statistics.median(m[k] for m in ms) for k in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms",
                                                                   "total_tokens_per_s")}
        out[v].update({k: sum(m[k] for m in ms) for k in COUNTERS})
        out[v]["per_run"] = ms
    ratio = {k: round(out["shmkv"][k] / out["vllm"][k], 3)
             for k in ("total_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms")}
    key, goal, how = GOALS[name]
    met = ratio[key] >= goal if how == "at least" else ratio[key] <= goal
    out["shmkv_over_vllm"] = ratio
    out["goal"] = {"figure": key, "goal": goal, "met": met}
    return out


def report(result: dict[str, Any]) -> None:
    print(f"shmkv bench concurrency ({result['model']} model; random: {result['random_tokens']}-token prompts; "
          f"prefix_repetition: {result['prefix_tokens']}-token prefixes; {result['runs']} runs each, medians):")
    print(f"{'dataset':<18} {'conc':>4} {'vLLM tok/s':>10} {'shmkv tok/s':>11} {'ratio':>6} "
          f"{'vLLM p50':>9} {'shmkv p50':>9} {'ratio':>6} {'goal':>5}")
    for row in result["rows"].values():
        v, s, q = row["vllm"], row["shmkv"], row["shmkv_over_vllm"]
        print(f"{row['dataset']:<18} {row['concurrency']:>4} {v['total_tokens_per_s']:>10} "
              f"{s['total_tokens_per_s']:>11} {q['total_tokens_per_s']:>6} {v['ttft_p50_ms']:>9} "
              f"{s['ttft_p50_ms']:>9} {q['ttft_p50_ms']:>6} {'met' if row['goal']['met'] else 'NOT':>5}")
