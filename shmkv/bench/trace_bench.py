"""`python -m shmkv.bench trace`: a production request trace (Mooncake
format; the conversation trace in shared/traces by default) replayed with
vLLM's own client (`vllm bench serve`, a custom dataset of the expanded
prompts, each row with its own output length) against two `vllm serve`
behind a round-robin proxy, `--max-concurrency` requests at a time (closed
loop, trace order), each arm on fresh servers of the same model and the same
small vLLM KV cache (`--kv-blocks`, as on a loaded GPU):

  vllm          vLLM alone (its prefix cache on)
  shmkv         shmkv, one shared segment of the budget
  shmkv_halves  shmkv, one segment of half the budget per server

The slice: every length divided by `--scale` (512-token blocks become
512/scale), then `--conversations` K sampled with all their turns (or the
first `--minutes`). Hash ids expand to the same tokens in every arm
(trace.py). Reuse is read from the servers' counters (vLLM's prefix-cache
hits, the external cache's hits), never inferred, and set against the
slice's ceilings: unlimited at vLLM's block and at shmkv's chunk, and an LRU
cache of the budget at shmkv's chunk. Timings: vLLM's client's own figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time
from typing import Any

from shmkv.bench import trace
from shmkv.bench.models import TEST_MODEL, TIMING_MODEL, words, write_llama, write_tokenizer
from shmkv.bench.serve_bench import COUNTERS, VLLM_BLOCK, Run, Workload, _counters
from shmkv.bench.vllm_server import RoundRobinProxy

DEFAULT_TRACE = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "traces",
                             "mooncake_conversation_trace.jsonl")
CHUNK = 256  # shmkv's default chunk
ARMS = ("vllm", "shmkv", "shmkv_halves")


def kv_bytes_per_token(spec: Any) -> int:
    head = spec.hidden_size // spec.num_attention_heads
    return 2 * spec.num_hidden_layers * spec.num_key_value_heads * head * 2  # K and V, bf16


class TraceRun(Run):
    """One replay's servers, slice and results (serve_bench.Run's servers, segments and client)."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        reqs = trace.scaled(trace.load(a.trace), a.scale)
        reqs = trace.first_minutes(reqs, a.minutes) if a.minutes else \
            trace.sample_conversations(reqs, a.conversations, a.seed)
        if not reqs:
            raise SystemExit(f"the slice of {a.trace} holds no request (--minutes {a.minutes}, "
                             f"--conversations {a.conversations})")
        self.block = trace.TRACE_BLOCK // a.scale
        self.requests = reqs
        self.outputs = [min(r.output_length, a.max_output) for r in reqs]
        longest = max(r.input_length + o for r, o in zip(reqs, self.outputs))
        self.max_model_len = -(-longest // VLLM_BLOCK) * VLLM_BLOCK + VLLM_BLOCK
        base = TEST_MODEL if a.small else TIMING_MODEL
        # positions up to the longest scaled prompt (RoPE: the random model works at any length)
        positions = max(base.max_position_embeddings, 1 << (self.max_model_len - 1).bit_length())
        self.spec = dataclasses.replace(base, max_position_embeddings=positions)
        self.model = write_llama(os.path.join(a.workdir, f"model-{'small' if a.small else 'timing'}-{positions}"),
                                 self.spec)
        write_tokenizer(self.model, self.spec.vocab_size)
        self.logs = os.path.join(a.workdir, "logs")
        self.data = os.path.join(a.workdir, f"data-{os.getpid()}")
        os.makedirs(self.logs, exist_ok=True)
        os.makedirs(self.data, exist_ok=True)
        self.prompts = [trace.prompt_tokens(r, self.block, self.spec.vocab_size, a.seed) for r in reqs]
        self.kv_blocks = max(a.kv_blocks, self.max_model_len // VLLM_BLOCK)
        self.per_token = kv_bytes_per_token(self.spec)
        ws = trace.working_set_units(self.prompts, CHUNK)
        self.budget = a.budget_mib << 20 if a.budget_mib else max(64 << 20, int(ws * CHUNK * self.per_token * 1.25))
        self.w = Workload(prefix_tokens=min(512, longest), suffix_tokens=32, output_tokens=4)  # warm-up shapes
        self.segments, self.starts = [], []
        self._seed, self._n = 0, 0
        self._client = None
        self._started, self._started_segments = {}, []

    def ceilings(self) -> dict[str, Any]:
        units = self.budget // (CHUNK * self.per_token)
        return {"prompt_tokens": sum(map(len, self.prompts)),
                "unlimited_vllm_block": trace.ceiling(self.prompts, VLLM_BLOCK),
                "unlimited_chunk": trace.ceiling(self.prompts, CHUNK),
                "lru_budget_chunk": trace.lru_ceiling(self.prompts, CHUNK, units),
                "working_set_bytes": trace.working_set_units(self.prompts, CHUNK) * CHUNK * self.per_token,
                "budget_bytes": self.budget}

    def arm(self, name: str) -> dict[str, Any]:
        if name == "vllm":
            caches, capacity = [None, None], None
        elif name == "shmkv":
            cache = self.segment("trace-shared")
            caches, capacity = [cache, cache], str(self.budget)
        elif name == "shmkv_halves":
            caches, capacity = [self.segment("trace-half-0"), self.segment("trace-half-1")], str(self.budget // 2)
        else:
            raise ValueError(f"arm {name!r}: expected one of {', '.join(ARMS)}")
        servers = self.servers([f"trace-{name}-{i}" for i in range(2)], caches, capacity)
        proxy = RoundRobinProxy([s.url for s in servers])
        try:
            dataset = self.dataset([{"prompt": words(p), "output_tokens": o}
                                    for p, o in zip(self.prompts, self.outputs)], f"trace-{name}")
            self.warm_up(servers)
            before = _counters(servers)
            t0 = time.perf_counter()
            r = self.client().run(proxy.url, self.model, dataset, dataset[:-6] + ".result.json",
                                  requests=len(self.prompts), output_tokens=-1,
                                  max_concurrency=self.a.max_concurrency, metrics="ttft,tpot,e2el",
                                  percentiles="50,90,99")
            wall = time.perf_counter() - t0
            after = _counters(servers)
        finally:
            proxy.close()
            for s in servers:
                s.close()
            self.drop_segments()
        if r.get("completed") != len(self.prompts):
            raise RuntimeError(f"{name}: vLLM's client completed {r.get('completed')} of {len(self.prompts)} "
                               f"requests; see {self.logs}")
        got = {k: int(after[k] - before[k]) for k in COUNTERS}
        reused = got["vllm_cache_tokens"] + got["connector_tokens"]
        return {**got, "reused_tokens": reused,
                "reused_fraction": round(reused / max(1, got["prompt_tokens"]), 4),
                "ttft_ms": {p: round(r[f"{p}_ttft_ms"], 2) for p in ("mean", "p50", "p90", "p99")},
                "tpot_p50_ms": round(r["p50_tpot_ms"], 2), "e2el_mean_ms": round(r["mean_e2el_ms"], 2),
                "requests_per_s": round(r["request_throughput"], 4),
                "total_tokens_per_s": round(r["total_token_throughput"], 2), "wall_s": round(wall, 2),
                "per_server_requests": list(proxy.sent),
                "ttfts_ms": [round(t * 1e3, 2) for t in r["ttfts"]]}  # per request, in the client's order


def run(argv: list[str]) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m shmkv.bench trace", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=DEFAULT_TRACE, help="a Mooncake-format JSONL trace")
    ap.add_argument("--scale", type=int, default=16, help="every length divided by this (a divisor of 512)")
    ap.add_argument("--conversations", type=int, default=12, help="conversations sampled with all their turns")
    ap.add_argument("--minutes", type=float, default=0, help="instead: the trace's first minutes")
    ap.add_argument("--max-output", type=int, default=32, help="output tokens at most per request")
    ap.add_argument("--max-concurrency", type=int, default=2)
    ap.add_argument("--kv-blocks", type=int, default=96, help="vLLM's KV cache per server, in blocks")
    ap.add_argument("--budget-mib", type=int, default=0,
                    help="shmkv's host memory (default: the slice's working set and a quarter)")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--small", action="store_true", help="the small test model (CI's check)")
    ap.add_argument("--workdir", default=None)
    a = ap.parse_args(argv)
    a.capacity = None
    if not os.path.exists(a.trace):
        raise SystemExit(f"--trace {a.trace}: no such file")
    a.workdir = a.workdir or tempfile.mkdtemp(prefix="shmkv-bench-trace-")
    r = TraceRun(a)
    try:
        arms = {name: r.arm(name) for name in a.arms.split(",")}
    finally:
        r.cleanup()
    out = {"bench": "trace", "trace": os.path.basename(a.trace), "scale": a.scale, "block_tokens": r.block,
           "requests": len(r.prompts), "conversations": len({q.conversation for q in r.requests}),
           "max_concurrency": a.max_concurrency, "kv_blocks": r.kv_blocks, "model": "small" if a.small else "timing",
           "ceilings": r.ceilings(), "arms": arms}
    base = arms.get("vllm")
    if base:
        out["ratios_to_vllm"] = {
            name: {"total_tokens_per_s": round(v["total_tokens_per_s"] / base["total_tokens_per_s"], 3),
                   **{f"ttft_{p}": round(v["ttft_ms"][p] / base["ttft_ms"][p], 3) for p in v["ttft_ms"]}}
            for name, v in arms.items() if name != "vllm"}
    return out


def report(result: dict[str, Any]) -> None:
    c = result["ceilings"]
    print(f"trace {result['trace']}: {result['requests']} requests of {result['conversations']} conversations, "
          f"scale 1/{result['scale']}, concurrency {result['max_concurrency']}, {c['prompt_tokens']} prompt tokens")
    print(f"ceilings: unlimited {c['unlimited_vllm_block']} (vLLM's block) / {c['unlimited_chunk']} (chunk); "
          f"LRU of the budget ({c['budget_bytes'] >> 20} MiB) {c['lru_budget_chunk']}")
    print(f"{'arm':<14} {'reused':>8} {'by vLLM':>8} {'external':>8} {'TTFT p50':>9} {'p90':>8} {'p99':>8} "
          f"{'mean':>8} {'tok/s':>8}")
    for name, v in result["arms"].items():
        t = v["ttft_ms"]
        print(f"{name:<14} {v['reused_tokens']:>8} {v['vllm_cache_tokens']:>8} {v['connector_tokens']:>8} "
              f"{t['p50']:>9} {t['p90']:>8} {t['p99']:>8} {t['mean']:>8} {v['total_tokens_per_s']:>8}")
